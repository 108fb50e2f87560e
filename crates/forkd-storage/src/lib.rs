//! forkd's snapshots, at rest and on the move.
//!
//! - [`snapshot`]: a snapshot directory (memory image, device state, disk layer, guest
//!   assets, manifest), sealed and published atomically; tags; chains of branches and
//!   their memory diffs.
//! - [`oci`]: snapshots as OCI image layouts, packed into archives and pushed to and
//!   pulled from registries; container images pulled or uploaded to make root
//!   filesystems.
//!
//! Nothing here starts a VM: what a disk layer's format needs is asked of the
//! hypervisor backend through [`forkd_hypervisor::Hypervisor`].

pub mod oci;
pub mod snapshot;
