//! `POST /v1/resume`: what a child restored from a snapshot must do before it is handed
//! out. Every child starts with its template's clock, kernel RNG state, interpreter seeds
//! and hostname; this gives it its own.

use crate::contexts::ReseedGate;
use crate::error::ApiError;
use crate::server::{parse_json, AppState};
use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use forkd_proto::context::{ResumeRequest, ResumeResponse};
use forkd_proto::ErrorCode;
use nix::time::{clock_gettime, clock_settime, ClockId};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

/// Most entropy bytes accepted in one request.
const MAX_ENTROPY: usize = 512;

/// How long the hook waits for a busy context before leaving it unreseeded.
const RESEED_WAIT: Duration = Duration::from_secs(10);

// From <linux/random.h>: RNDADDENTROPY = _IOW('R', 0x03, int[2]), RNDRESEEDCRNG = _IO('R', 0x07).
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// `POST /v1/resume`.
pub async fn resume(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<ResumeResponse>, ApiError> {
    let req: ResumeRequest = parse_json(&body)?;
    // The contexts' reseeds start as the handler returns.
    apply(&state, req).await.map(|(r, _gate)| Json(r))
}

/// Runs the resume hook (from `POST /v1/resume`, or from the greeting that carried it).
/// The contexts' reseeds, queued, start when the gate returned is dropped.
pub async fn apply(
    state: &AppState,
    req: ResumeRequest,
) -> Result<(ResumeResponse, Option<ReseedGate>), ApiError> {
    let own_machine = state.mode == crate::server::Mode::Pid1;
    if req.continuing {
        // The clock stood still while the machine was paused; nothing else of it changes.
        let clock_step_ms = if own_machine {
            set_clock(req.wall_clock_ns)?
        } else {
            0
        };
        return Ok((
            ResumeResponse {
                clock_step_ms,
                contexts_reseeded: 0,
            },
            None,
        ));
    }
    let entropy = hex::decode(&req.entropy_hex)
        .map_err(|e| ApiError::invalid(format!("entropy_hex is not a hex string: {e}")))?;
    if entropy.is_empty() || entropy.len() > MAX_ENTROPY {
        return Err(ApiError::invalid(format!(
            "entropy must be 1 to {MAX_ENTROPY} bytes, got {}",
            entropy.len()
        )));
    }
    // Mixing bytes into the kernel RNG is harmless anywhere; the clock and the hostname
    // are only a guest's own.
    reseed_kernel(&entropy)?;
    let clock_step_ms = if own_machine {
        set_clock(req.wall_clock_ns)?
    } else {
        0
    };
    if own_machine && !req.hostname.is_empty() {
        nix::unistd::sethostname(&req.hostname).map_err(|e| {
            ApiError::new(ErrorCode::Io, format!("setting the hostname failed: {e}"))
        })?;
    }
    if let Some(problem) = forkd_proto::exec::env_problem(&req.env) {
        return Err(ApiError::invalid(problem));
    }
    state.add_env(&req.env);
    let (contexts_reseeded, gate) = state
        .contexts
        .reseed_all(RESEED_WAIT, &req.env, req.settle)
        .await;
    Ok((
        ResumeResponse {
            clock_step_ms,
            contexts_reseeded,
        },
        Some(gate),
    ))
}

/// Sets CLOCK_REALTIME; returns the step in milliseconds.
fn set_clock(wall_clock_ns: u64) -> Result<i64, ApiError> {
    let err =
        |e: nix::Error| ApiError::new(ErrorCode::Io, format!("setting the clock failed: {e}"));
    let before = clock_gettime(ClockId::CLOCK_REALTIME).map_err(err)?;
    let secs = i64::try_from(wall_clock_ns / 1_000_000_000)
        .map_err(|_| ApiError::invalid("wall_clock_ns is out of range"))?;
    let nanos = i64::try_from(wall_clock_ns % 1_000_000_000).unwrap_or(0);
    let ts = nix::sys::time::TimeSpec::new(secs, nanos);
    clock_settime(ClockId::CLOCK_REALTIME, ts).map_err(err)?;
    let to_ms = |t: nix::sys::time::TimeSpec| t.tv_sec() * 1000 + t.tv_nsec() / 1_000_000;
    Ok(to_ms(ts) - to_ms(before))
}

/// Mixes `entropy` into the kernel's pool (crediting it) and forces a CRNG reseed, so
/// `getrandom` and `/dev/urandom` in this child diverge from every sibling at once.
fn reseed_kernel(entropy: &[u8]) -> Result<(), ApiError> {
    let err = |what: &str, e: std::io::Error| {
        ApiError::new(
            ErrorCode::Io,
            format!("reseeding the kernel RNG ({what}) failed: {e}"),
        )
    };
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")
        .map_err(|e| err("open /dev/random", e))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let len = i32::try_from(entropy.len()).unwrap_or(0);
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&(len * 8).to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(entropy);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow the two
    // ints; `info` holds exactly that and outlives the call.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    if rc < 0 {
        return Err(err("RNDADDENTROPY", std::io::Error::last_os_error()));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) };
    if rc < 0 {
        return Err(err("RNDRESEEDCRNG", std::io::Error::last_os_error()));
    }
    Ok(())
}
