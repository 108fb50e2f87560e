//! What is done to one snapshot of this host as a whole: its removal.

use super::ApiError;
use crate::api::App;
use crate::registry::RegistryError;
use forkd_core::SandboxError;
use forkd_storage::snapshot::Tag;

/// Removes the snapshot `tag` of this host (its children first with `force`; else it
/// is refused while anything uses it), and in a cluster its tag if no other living host
/// holds it.
pub async fn remove(app: &App, tag: &Tag, force: bool) -> Result<(), ApiError> {
    if force {
        for id in app.registry.children_of(tag.as_str()) {
            // One that went away meanwhile (deleted, timed out) is as good as stopped.
            match app.registry.delete(&id).await {
                Ok(()) | Err(RegistryError::Sandbox(SandboxError::NotFound { .. })) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    // Its pool members hold its files open: they go first (and come back if the
    // snapshot stays).
    let store = app.registry.store();
    let digest = super::tags::digest_of(app, tag);
    app.registry.drain_pool(tag.as_str()).await;
    let removed = store.remove(tag, &app.registry.users_of(tag.as_str()));
    app.registry.reopen_pool(tag.as_str(), removed.is_ok());
    removed?;
    if let Some(digest) = digest {
        super::tags::release_removed(app, tag, &digest).await;
    }
    Ok(())
}
