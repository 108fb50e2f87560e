//! Errors of the hypervisor layer, in words that hold for any backend: a backend names
//! its own programs and control protocol in the fields it fills in.

/// Something went wrong starting or driving a VM.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    #[error("could not start {program}: {source} (install it: {install})")]
    Spawn {
        /// The program that failed to start.
        program: String,
        /// Why.
        source: std::io::Error,
        /// What provides it (`apt-get install qemu-system-x86`).
        install: &'static str,
    },
    #[error("{program} exited during start-up ({status}): {stderr}")]
    EarlyExit {
        /// The hypervisor program (`QEMU`).
        program: &'static str,
        /// Exit status.
        status: String,
        /// The tail of its stderr.
        stderr: String,
    },
    #[error("the guest CPU model {model} is not available with {accel} on this host ({missing}); a snapshot forks only where its CPU model is: build the template on this host, or give its recipe a `cpu` this host has")]
    CpuModel {
        /// The model.
        model: String,
        /// The accelerator.
        accel: crate::Accel,
        /// What the hypervisor said is missing.
        missing: String,
    },
    #[error("the VM's control socket {socket} did not answer within {secs} s")]
    ControlTimeout {
        /// The control socket (QEMU's QMP socket).
        socket: String,
        /// How long we waited.
        secs: u64,
    },
    #[error("control command {command} failed: {class}: {desc}")]
    Control {
        /// The command.
        command: String,
        /// The hypervisor's error class.
        class: String,
        /// The hypervisor's description.
        desc: String,
    },
    #[error("the VM's control connection was lost ({0}); the VM has probably exited")]
    ControlClosed(String),
    #[error("KVM was requested but cannot be used: {0}")]
    KvmUnavailable(String),
    #[error("VM {id} is not running (its hypervisor process, pid {pid}, is gone)")]
    NotRunning {
        /// The VM's id.
        id: String,
        /// The pid it had.
        pid: u32,
    },
    #[error("device state migration failed: {0}")]
    Migration(String),
    #[error("device state migration did not finish within {secs} s")]
    MigrationTimeout {
        /// How long we waited.
        secs: u64,
    },
    #[error("sandbox network: {0}")]
    Network(String),
    #[error("invalid VM configuration: {0}")]
    Config(String),
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl HypervisorError {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        HypervisorError::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<forkd_host::network::NetworkError> for HypervisorError {
    fn from(e: forkd_host::network::NetworkError) -> Self {
        HypervisorError::Network(e.to_string())
    }
}
