//! The daemon's use cases, one function each: a fork, a branch, a pause and a resume, a
//! delete, a change of a sandbox's egress or deadline. Each checks what it is asked,
//! admits it and runs it.
//! The front doors (the REST API, E2B's API, and MCP, whose tools call the REST API)
//! only translate their requests into these calls and the results into their answers,
//! so a rule is written once and a new front door or verb cannot miss one.
//!
//! Every mutating request is recorded in the audit log before it gets here, by the
//! listeners' middleware (see [`crate::server`]), whichever front door it came through.
//! Errors are [`ApiError`]s: a status class, a code and a message, which each front
//! door renders in its own shape.

pub mod branch;
pub mod cluster;
pub mod fork;
pub mod moving;
pub mod pause;
pub mod placement;
pub mod sandbox;
pub mod snapshot;
pub mod tags;

pub use crate::api::ApiError;
