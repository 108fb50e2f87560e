//! Errors of the hypervisor layer.

use std::path::PathBuf;

/// Something went wrong starting or driving a VM.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    /// could not start {program}: {source} (install it: apt-get install qemu-system-x86)
    #[error("could not start {program}: {source} (install it: apt-get install qemu-system-x86)")]
    Spawn {
        /// The program that failed to start.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// QEMU exited during start-up ({status}): {stderr}
    #[error("QEMU exited during start-up ({status}): {stderr}")]
    EarlyExit {
        /// Exit status.
        status: String,
        /// The tail of QEMU's stderr.
        stderr: String,
    },
    /// the guest CPU model {model} is not available with {accel} on this host ({missing})
    #[error("the guest CPU model {model} is not available with {accel} on this host ({missing}); a snapshot forks only where its CPU model is: build the template on this host, or give its recipe a `cpu` this host has")]
    CpuModel {
        /// The model.
        model: String,
        /// The accelerator.
        accel: crate::Accel,
        /// What QEMU said is missing.
        missing: String,
    },
    /// QEMU's control socket {path} did not answer within {secs} s
    #[error("QEMU's control socket {} did not answer within {secs} s", path.display())]
    QmpTimeout {
        /// The QMP socket.
        path: PathBuf,
        /// How long we waited.
        secs: u64,
    },
    /// QMP command {command} failed: {class}: {desc}
    #[error("QMP command {command} failed: {class}: {desc}")]
    Qmp {
        /// The command.
        command: String,
        /// QEMU's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// QMP connection lost ({0}); the VM has probably exited
    #[error("QMP connection lost ({0}); the VM has probably exited")]
    QmpClosed(String),
    /// KVM was requested but cannot be used: {0}
    #[error("KVM was requested but cannot be used: {0}")]
    KvmUnavailable(String),
    /// VM {id} is not running (its QEMU, pid {pid}, is gone)
    #[error("VM {id} is not running (its QEMU, pid {pid}, is gone)")]
    NotRunning {
        /// The VM's id.
        id: String,
        /// The pid it had.
        pid: u32,
    },
    /// device state migration failed: {0}
    #[error("device state migration failed: {0}")]
    Migration(String),
    /// device state migration did not finish within {secs} s
    #[error("device state migration did not finish within {secs} s")]
    MigrationTimeout {
        /// How long we waited.
        secs: u64,
    },
    /// invalid VM configuration: {0}
    #[error("sandbox network: {0}")]
    Network(String),

    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// {context}: {source}
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl HypervisorError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        HypervisorError::Io {
            context: context.into(),
            source,
        }
    }
}
