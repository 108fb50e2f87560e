//! Branching a running VM with stock QEMU: an ordinary pre-copy migration of the source
//! into a *receiver*, a second QEMU that never runs and whose RAM is a fresh shared file.
//!
//! Why this way (measured; see docs/architecture.md): QEMU's `background-snapshot` refuses
//! a child whose RAM is a private mapping of a file on ext4, and a migration stream alone
//! is not something a child can map. The receiver turns the stream into exactly what a
//! snapshot is made of: its RAM file holds the memory (zero pages stay holes), and a
//! second, RAM-less migration of the receiver gives the device state.
//!
//! The branch instant is the migration's switch-over: QEMU stops the source's vCPUs for
//! the last dirty pages and the device state. With `pause-before-switchover` QEMU waits
//! there for us, vCPUs stopped and disks still active, so the disk is frozen at that same
//! instant: `blockdev-snapshot` moves the source onto a new empty layer and the
//! layer below becomes the branch's disk. The source then resumes with `cont` from
//! `postmigrate`, which also takes back its disks.

use super::version::QemuVersion;
use crate::vm::{QemuVm, Start};
use forkd_hypervisor::{Accel, BranchMode, BranchPlan, BranchStats, HypervisorError, Vm};
use serde_json::json;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// Name under which each side's end of the stream is handed over (`getfd`).
const STREAM_FD: &str = "forkd-branch";

/// The longest switch-over QEMU aims for (`downtime-limit`, ms): it keeps copying what the
/// guest dirtied until the rest fits in this.
const DOWNTIME_LIMIT_MS: u64 = 20;

/// No bandwidth cap: the stream is a local socket (QEMU 7.2's default is 32 MiB/s).
const MAX_BANDWIDTH: u64 = 1 << 40;

/// How long the receiver may take to quit.
const RECEIVER_GRACE: Duration = Duration::from_secs(5);

/// The top layer's file from a block node's file name: a path, or, once the layer's
/// backing was opened under another name than its header gives (a branch's next layer),
/// `json:{...}` with the top file under `file.filename`.
fn top_file(name: &str) -> Option<std::path::PathBuf> {
    match name.strip_prefix("json:") {
        None => Some(name.into()),
        Some(json) => serde_json::from_str::<serde_json::Value>(json).ok()?["file"]["filename"]
            .as_str()
            .map(Into::into),
    }
}

/// The set id of a `/dev/fdset/N` file name.
fn fdset_id(file: &std::path::Path) -> Option<u64> {
    file.to_str()?.strip_prefix("/dev/fdset/")?.parse().ok()
}

/// The opaque string of descriptor set `id` in a `query-fdsets` answer.
fn fdset_opaque(sets: &serde_json::Value, id: u64) -> Option<String> {
    sets.as_array()?
        .iter()
        .find(|s| s["fdset-id"].as_u64() == Some(id))?["fds"]
        .as_array()?
        .iter()
        .find_map(|fd| fd["opaque"].as_str().map(str::to_owned))
}

/// The first QEMU whose live migration under TCG keeps every guest store: before 9.0 the
/// fast path of the dirty-bitmap sync cleared bits without telling TCG's software TLB, so
/// stores through a TLB entry filled while its page was dirty were never tracked again
/// and the receiver kept an old copy of the page (fixed upstream by commit 03bfc2188f,
/// "physmem: Fix migration dirty bitmap coherency with TCG memory access"). Measured
/// here: with 7.2 every live branch of a guest with a process rewriting 1024 pages in a
/// loop gave children pages from several instants and a dead writer; with 10.0 none did.
const FAITHFUL_TCG_MIGRATION: QemuVersion = QemuVersion(9, 0, 0);

/// Whether a live branch of a VM under `accel`, run by QEMU `version`, copies every page
/// the guest writes; if not, why. KVM tracks dirty pages itself and is not affected.
pub(super) fn live_copy_is_faithful(
    accel: Accel,
    version: Option<QemuVersion>,
) -> Result<(), String> {
    if accel != Accel::Tcg {
        return Ok(());
    }
    match version {
        Some(v) if v >= FAITHFUL_TCG_MIGRATION => Ok(()),
        Some(v) => Err(format!(
            "a live branch under TCG needs QEMU {FAITHFUL_TCG_MIGRATION} or newer: QEMU {v} loses guest writes made while it copies memory; use mode pause, or install a newer QEMU (on Debian bookworm: bookworm-backports' qemu-system-x86) and start the sandbox again"
        )),
        None => Err(format!(
            "a live branch under TCG needs QEMU {FAITHFUL_TCG_MIGRATION} or newer, and this QEMU did not say its version; use mode pause"
        )),
    }
}

/// The block node name of a disk layer added at a branch: from its file name, which is
/// unique in the sandbox's directory (`root.3.qcow2` is `layer-root.3`). QEMU allows
/// letters, digits, `-`, `.` and `_`, starting with a letter.
fn layer_node_name(layer: &std::path::Path) -> String {
    let stem = layer
        .file_stem()
        .map(|s| s.to_string_lossy())
        .unwrap_or_default();
    let clean: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("layer-{clean}")
}

/// A migration that went through its switch-over.
struct Switched {
    /// The source's top disk layer at the branch instant.
    frozen_layer: std::path::PathBuf,
    /// QEMU's measure of the stop: from the vCPUs' stop to the end of the stream.
    downtime_ms: u64,
    /// Bytes sent.
    transferred: u64,
    /// When the end was seen.
    completed_at: Instant,
}

impl QemuVm {
    /// See [`Vm::branch`].
    pub(super) async fn branch_into(
        &self,
        mode: BranchMode,
        plan: &BranchPlan,
    ) -> Result<BranchStats, HypervisorError> {
        let receiver = QemuVm::start(&self.binary, &plan.receiver, Start::Receive).await?;
        let result = self.migrate_into(&receiver, mode, plan).await;
        let result = match result {
            Ok(stats) => receiver.finish_receiving(&plan.state).await.map(|()| stats),
            Err(e) => Err(e),
        };
        let _ = receiver.stop(RECEIVER_GRACE).await;
        result
    }

    /// Streams this VM into `receiver` and freezes its disk at the switch-over. Whatever
    /// fails, the source runs again when this returns.
    async fn migrate_into(
        &self,
        receiver: &QemuVm,
        mode: BranchMode,
        plan: &BranchPlan,
    ) -> Result<BranchStats, HypervisorError> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| HypervisorError::io("creating the branch stream", e))?;
        receiver.set_capabilities(false, false).await?;
        receiver
            .qmp
            .execute_with_fd(
                "getfd",
                Some(json!({ "fdname": STREAM_FD })),
                theirs.as_fd(),
            )
            .await?;
        drop(theirs);
        receiver
            .qmp
            .execute(
                "migrate-incoming",
                Some(json!({ "uri": format!("fd:{STREAM_FD}") })),
            )
            .await?;

        // The source's RAM is a private mapping, so it is not "shared" for QEMU: with or
        // without x-ignore-shared it is sent; off, so that the receiver accepts it.
        self.set_capabilities(false, true).await?;
        self.qmp
            .execute(
                "migrate-set-parameters",
                Some(json!({
                    "max-bandwidth": MAX_BANDWIDTH,
                    "downtime-limit": DOWNTIME_LIMIT_MS,
                })),
            )
            .await?;
        self.qmp
            .execute_with_fd("getfd", Some(json!({ "fdname": STREAM_FD })), ours.as_fd())
            .await?;
        drop(ours);

        let started = Instant::now();
        let stopped_at = match mode {
            BranchMode::Pause => {
                self.qmp.execute("stop", None).await?;
                Some(Instant::now())
            }
            BranchMode::Live => None,
        };
        let outcome = self.copy_and_switch(plan).await;
        // A pause to disk that captured the source leaves it stopped, for its caller to
        // end: it must not run on past the instant its image holds.
        if plan.next_layer.is_none() {
            if let Ok(switched) = &outcome {
                return Ok(BranchStats {
                    frozen_layer: switched.frozen_layer.clone(),
                    pause: Duration::from_millis(switched.downtime_ms),
                    copy: switched.completed_at - started,
                    transferred: switched.transferred,
                });
            }
        }
        // The source runs again whatever happened (from `postmigrate`, `cont` also takes
        // back the disks the migration handed over).
        let resumed = self.resume_after_migration().await;
        let running_again = Instant::now();
        let switched = outcome?;
        resumed?;
        let frozen_layer = switched.frozen_layer;
        let pause = match stopped_at {
            Some(t) => running_again - t,
            // QEMU's downtime runs from the stop to the end of the migration; the source
            // stays stopped until `cont` answers.
            None => {
                Duration::from_millis(switched.downtime_ms)
                    + running_again.saturating_duration_since(switched.completed_at)
            }
        };
        Ok(BranchStats {
            frozen_layer,
            pause,
            copy: running_again - started,
            transferred: switched.transferred,
        })
    }

    /// Runs the migration to its switch-over, freezes the disk there, lets it finish.
    async fn copy_and_switch(&self, plan: &BranchPlan) -> Result<Switched, HypervisorError> {
        let events = self.qmp.events();
        self.qmp
            .execute("migrate", Some(json!({ "uri": format!("fd:{STREAM_FD}") })))
            .await?;
        let status = self.migration_reaches(events, &["pre-switchover"]).await?;
        let at_switchover = Instant::now();
        let drop_next_layer = || {
            if let Some(next) = &plan.next_layer {
                let _ = std::fs::remove_file(next);
            }
        };
        if status != "pre-switchover" {
            drop_next_layer();
            return Err(self.migration_failed("copying the memory", &status).await);
        }
        // vCPUs stopped, nothing in flight: the branch instant. The disk is frozen here.
        if let Some(f) = plan.at_instant {
            f();
        }
        let switched_disk = async {
            let frozen_layer = self.disk_top().await?;
            if let Some(next) = &plan.next_layer {
                self.put_layer_on_top(next).await?;
            }
            Ok::<_, HypervisorError>(frozen_layer)
        };
        let frozen_layer = match switched_disk.await {
            Ok(p) => p,
            Err(e) => {
                drop_next_layer();
                let _ = self.qmp.execute("migrate_cancel", None).await;
                let _ = self.migration_end(self.qmp.events()).await;
                return Err(e);
            }
        };
        let events = self.qmp.events();
        self.qmp
            .execute(
                "migrate-continue",
                Some(json!({ "state": "pre-switchover" })),
            )
            .await?;
        let continued_at = Instant::now();
        let status = self.migration_end(events).await?;
        let completed_at = Instant::now();
        if status != "completed" {
            return Err(self.migration_failed("the switch-over", &status).await);
        }
        let info = self.qmp.execute("query-migrate", None).await?;
        tracing::debug!(
            disk_switch_ms = (continued_at - at_switchover).as_secs_f64() * 1e3,
            last_pass_ms = (completed_at - continued_at).as_secs_f64() * 1e3,
            downtime_ms = info["downtime"].as_u64(),
            downtime_bytes = info["ram"]["downtime-bytes"].as_u64(),
            dirty_syncs = info["ram"]["dirty-sync-count"].as_u64(),
            mbps = info["ram"]["mbps"].as_f64(),
            "branch switch-over"
        );
        Ok(Switched {
            frozen_layer,
            downtime_ms: info["downtime"].as_u64().unwrap_or(0),
            transferred: info["ram"]["transferred"].as_u64().unwrap_or(0),
            completed_at,
        })
    }

    /// Moves the root disk onto `layer`, an empty qcow2 image whose header names the
    /// current top as its backing file. Added as a node of its own rather than with
    /// `blockdev-snapshot-sync`, so that its file keeps the page cache like every other
    /// layer (see `cmdline::keep_page_cache`) and keeps the drive's `cache=unsafe`.
    ///
    /// The layer is opened here and handed over in a descriptor set (`add-fd`, the path
    /// kept as its `opaque`): a jailed QEMU can open no file by its path.
    async fn put_layer_on_top(&self, layer: &std::path::Path) -> Result<(), HypervisorError> {
        let node = layer_node_name(layer);
        let opened = |write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(layer)
                .map_err(|e| HypervisorError::io(format!("opening {}", layer.display()), e))
        };
        let (rw, ro) = (opened(true)?, opened(false)?);
        let opaque = layer.to_string_lossy();
        let added = self
            .qmp
            .execute_with_fd("add-fd", Some(json!({ "opaque": opaque })), rw.as_fd())
            .await?;
        let fdset = added["fdset-id"].as_u64().ok_or_else(|| {
            HypervisorError::Migration(format!("add-fd answered without a fdset-id: {added}"))
        })?;
        // Its read-only twin: QEMU reopens the layer read-only when it no longer writes
        // it (once a later branch puts another layer on top).
        self.qmp
            .execute_with_fd(
                "add-fd",
                Some(json!({ "fdset-id": fdset, "opaque": opaque })),
                ro.as_fd(),
            )
            .await?;
        drop((rw, ro));
        self.qmp
            .execute(
                "blockdev-add",
                Some(json!({
                    "driver": "qcow2",
                    "node-name": node,
                    "cache": { "no-flush": true },
                    "file": {
                        "driver": "file",
                        "filename": format!("/dev/fdset/{fdset}"),
                        "drop-cache": false,
                        "auto-read-only": true,
                        // As the first top layer (see cmdline.rs).
                        "locking": "off",
                    },
                    // Attached below by blockdev-snapshot, to the node now on top.
                    "backing": null,
                })),
            )
            .await?;
        let moved = self
            .qmp
            .execute(
                "blockdev-snapshot",
                Some(json!({ "node": "root", "overlay": node })),
            )
            .await;
        if moved.is_err() {
            let _ = self
                .qmp
                .execute("blockdev-del", Some(json!({ "node-name": node })))
                .await;
        }
        moved.map(drop)
    }

    /// `cont` once the migration has let go of the VM. QEMU sends the `completed` event
    /// from the migration thread before the main loop leaves `finish-migrate`, and
    /// refuses `cont` until then ("Migration is not finalized yet"): a few ms at most.
    async fn resume_after_migration(&self) -> Result<(), HypervisorError> {
        let started = Instant::now();
        let deadline = started + Duration::from_secs(10);
        let mut refused = 0u32;
        loop {
            match self.qmp.execute("cont", None).await {
                Err(HypervisorError::Control { desc, .. })
                    if desc.contains("not finalized") && Instant::now() < deadline =>
                {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                other => {
                    tracing::debug!(
                        refused,
                        ms = started.elapsed().as_secs_f64() * 1e3,
                        "cont after the migration"
                    );
                    return other.map(drop);
                }
            }
        }
    }

    /// The file of the root disk's top layer, as QEMU has it open.
    pub(super) async fn disk_top(&self) -> Result<std::path::PathBuf, HypervisorError> {
        let blocks = self.qmp.execute("query-block", None).await?;
        let top = blocks
            .as_array()
            .into_iter()
            .flatten()
            .find(|b| b["device"] == "root")
            .and_then(|b| b["inserted"]["file"].as_str())
            .and_then(top_file);
        // A layer handed over as a descriptor set: its path is the set's opaque.
        let top = match top.as_ref().and_then(|t| fdset_id(t)) {
            Some(id) => {
                let sets = self.qmp.execute("query-fdsets", None).await?;
                fdset_opaque(&sets, id).map(Into::into)
            }
            None => top,
        };
        top.ok_or_else(|| {
            HypervisorError::Migration("QEMU does not list the root disk's file".into())
        })
    }

    /// See [`Vm::abandon_branch`].
    pub(super) async fn abandon_migration(&self) -> Result<(), HypervisorError> {
        let now = self.qmp.execute("query-migrate", None).await?;
        let status = now["status"].as_str().unwrap_or("none");
        if !matches!(status, "none" | "completed" | "failed" | "cancelled") {
            let events = self.qmp.events();
            self.qmp.execute("migrate_cancel", None).await?;
            self.migration_end(events).await?;
        }
        let run = self.qmp.execute("query-status", None).await?;
        if run["status"] != "running" {
            self.resume_after_migration().await?;
        }
        Ok(())
    }

    /// On the receiver: waits for the stream to end, then writes the device state (its
    /// RAM, a shared file, is left out: the file is the branch's memory image).
    async fn finish_receiving(&self, state: &std::path::Path) -> Result<(), HypervisorError> {
        let status = self.migration_end(self.qmp.events()).await?;
        if status != "completed" {
            return Err(self.migration_failed("receiving the branch", &status).await);
        }
        self.save_state(state).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_copies_under_tcg_need_qemu_9() {
        assert!(live_copy_is_faithful(Accel::Tcg, Some(QemuVersion(10, 0, 2))).is_ok());
        assert!(live_copy_is_faithful(Accel::Tcg, Some(QemuVersion(9, 0, 0))).is_ok());
        let e = live_copy_is_faithful(Accel::Tcg, Some(QemuVersion(7, 2, 22))).unwrap_err();
        assert!(e.contains("QEMU 7.2.22") && e.contains("mode pause"), "{e}");
        assert!(live_copy_is_faithful(Accel::Tcg, None).is_err());
        assert!(live_copy_is_faithful(Accel::Kvm, Some(QemuVersion(7, 2, 0))).is_ok());
    }

    #[test]
    fn layer_node_names_are_valid_and_unique_per_file() {
        assert_eq!(
            layer_node_name(std::path::Path::new("/a/root.3.qcow2")),
            "layer-root.3"
        );
        assert_eq!(
            layer_node_name(std::path::Path::new("/a/r t+1.qcow2")),
            "layer-r_t_1"
        );
    }

    #[test]
    fn the_top_file_of_a_layered_disk() {
        assert_eq!(
            super::top_file("/a/root.qcow2"),
            Some("/a/root.qcow2".into())
        );
        let json = r#"json:{"backing": {"driver": "qcow2", "file": {"driver": "file", "filename": "/a/root.qcow2"}}, "driver": "qcow2", "file": {"driver": "file", "filename": "/a/root.1.qcow2"}}"#;
        assert_eq!(super::top_file(json), Some("/a/root.1.qcow2".into()));
        assert_eq!(super::top_file("json:{"), None);
    }

    #[test]
    fn a_layer_handed_over_as_a_descriptor_set_is_named_by_its_opaque() {
        assert_eq!(fdset_id(std::path::Path::new("/dev/fdset/3")), Some(3));
        assert_eq!(fdset_id(std::path::Path::new("/a/root.qcow2")), None);
        let sets = json!([
            {"fdset-id": 1, "fds": [{"fd": 30, "opaque": "/a/root.1.qcow2"}]},
            {"fdset-id": 3, "fds": [{"fd": 31, "opaque": "/a/root.2.qcow2"}]}
        ]);
        assert_eq!(fdset_opaque(&sets, 3), Some("/a/root.2.qcow2".into()));
        assert_eq!(fdset_opaque(&sets, 2), None);
    }
}
