//! Pseudo-terminals for commands run with [`forkd_proto::exec::ExecRequest::pty`]: the
//! command gets the terminal's slave side as its stdin, stdout, stderr and controlling
//! terminal (a session of its own, as a login on a console has); the agent keeps the
//! master side, reads the command's output from it and writes the host's input and
//! window sizes to it.

use forkd_proto::exec::PtySize;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Stdio;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The agent's side of a command's terminal.
pub struct Master {
    fd: AsyncFd<OwnedFd>,
}

/// A new terminal of `size`: its master (for the agent) and three handles of its slave
/// (the command's stdin, stdout and stderr).
pub fn open(size: PtySize) -> io::Result<(Master, [Stdio; 3])> {
    let pty = nix::pty::openpty(Some(&winsize(size)), None).map_err(io::Error::from)?;
    let flags = nix::fcntl::fcntl(pty.master.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map_err(io::Error::from)?;
    let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(pty.master.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))
        .map_err(io::Error::from)?;
    // The master must not leak into the commands the agent runs.
    nix::fcntl::fcntl(
        pty.master.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(io::Error::from)?;
    let slave = [
        Stdio::from(pty.slave.try_clone()?),
        Stdio::from(pty.slave.try_clone()?),
        Stdio::from(pty.slave),
    ];
    // SAFETY: the master is owned here and handed whole to the AsyncFd, which alone
    // closes it, after deregistering it.
    let fd = unsafe { AsyncFd::register(pty.master) }.map_err(io::Error::from)?;
    Ok((Master { fd }, slave))
}

fn winsize(size: PtySize) -> nix::pty::Winsize {
    nix::pty::Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// In the forked child before exec: a session of its own whose controlling terminal is
/// its stdin (the terminal's slave). Only async-signal-safe calls.
pub fn make_controlling() -> io::Result<()> {
    nix::unistd::setsid().map_err(io::Error::from)?;
    // SAFETY: TIOCSCTTY takes an int argument (0: do not steal a terminal another
    // session holds); fd 0 is the slave the parent set up.
    if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Master {
    /// Reads what the command wrote; 0 once every holder of the slave closed it (the
    /// kernel reports that as EIO on the master).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let r = self
                .fd
                .async_io(Interest::READABLE, |fd| {
                    nix::unistd::read(fd.as_raw_fd(), buf).map_err(io::Error::from)
                })
                .await;
            match r {
                Err(e) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => return r,
            }
        }
    }

    /// Writes all of `data` as typed input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let n = self
                .fd
                .async_io(Interest::WRITABLE, |fd| {
                    nix::unistd::write(fd, data).map_err(io::Error::from)
                })
                .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            data = &data[n..];
        }
        Ok(())
    }

    /// Sets the terminal's size; the kernel tells its foreground processes (SIGWINCH).
    pub fn resize(&self, size: PtySize) -> io::Result<()> {
        let ws = winsize(size);
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer, valid for the call.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
