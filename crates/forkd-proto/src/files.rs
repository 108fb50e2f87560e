//! File operations in the guest.

use serde::{Deserialize, Serialize};

/// What kind of thing a path names.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed by stat or list).
    Symlink,
    /// A device, socket or fifo.
    Other,
}

/// Metadata of one path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileStat {
    /// The absolute path.
    pub path: String,
    /// Its last component.
    pub name: String,
    /// File, dir, symlink or other.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Modification time, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
}

/// Query naming one path (`?path=/etc/hostname`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PathQuery {
    /// An absolute path in the guest.
    pub path: String,
}

/// Query of a file write.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WriteQuery {
    /// An absolute path in the guest; the file is replaced atomically (written next to it,
    /// then renamed).
    pub path: String,
    /// Permission bits of the new file; 0o644 by default.
    #[serde(default)]
    pub mode: Option<u32>,
    /// Create missing parent directories.
    #[serde(default)]
    pub parents: bool,
    /// Give the new file (and the directories created for it) to this user of the guest
    /// and its group; root's otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Body of `POST /v1/files/mkdir`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MkdirRequest {
    /// Directory to create, with its missing parents; an existing directory is fine.
    pub path: String,
    /// Give the directories created to this user of the guest and its group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Body of `POST /v1/files/remove`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoveRequest {
    /// Path to remove.
    pub path: String,
    /// Remove a directory and everything in it. Without it a non-empty directory is
    /// refused with `directory_not_empty`.
    #[serde(default)]
    pub recursive: bool,
}

/// Body of `POST /v1/files/rename`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RenameRequest {
    /// Existing path.
    pub from: String,
    /// New path (replaced if it is a file).
    pub to: String,
}

/// Query of [`crate::routes::FILES_WATCH`] (protocol 6).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchQuery {
    /// An absolute path of a directory in the guest.
    pub path: String,
    /// Its subdirectories too (those made while it is watched as well).
    #[serde(default)]
    pub recursive: bool,
}

/// What happened to a watched path.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    /// Made (or moved in).
    Create,
    /// Written.
    Write,
    /// Removed.
    Remove,
    /// Moved away (or renamed; its new name comes as a `create`).
    Rename,
    /// Its mode, owner or times changed.
    Chmod,
    /// Events were lost: more came than the watcher's queue holds (`dropped` says how
    /// many at least). What a watcher saw before and after is still exact.
    Overflow,
}

/// One line of a watch's NDJSON stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchEvent {
    /// What happened.
    #[serde(rename = "type")]
    pub kind: WatchKind,
    /// The path it happened to (absolute; empty for an overflow).
    #[serde(default)]
    pub path: String,
    /// Whether the path is a directory.
    #[serde(default)]
    pub dir: bool,
    /// For an overflow: how many events were dropped at least.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped: Option<u64>,
}
