//! What forkd uses of the Linux host around its VMs, whatever the hypervisor: a VM's
//! cgroup and resource limits, its network namespace and egress rules, the scheduling of
//! its threads, the capabilities its process keeps, and facts about host processes.
//!
//! Nothing here starts a VM; a backend (the QEMU crate) puts its process into what this
//! crate makes.

pub mod atomic_file;
pub mod capped_log;
pub mod caps;
pub mod cgroup;
pub mod enforcement;
pub mod failpoint;
pub mod ids;
pub mod lifeline;
pub mod mountinfo;
pub mod network;
pub mod process;
pub mod sched;
pub mod smaps;
pub mod space;
