//! WASI preview 1 imports (`fd_write`, `clock_time_get`, `random_get`, `environ_*`, `proc_exit`, ...)
//! from wasmtime-wasi.
//!
//! wasmtime-wasi's synchronous p1 functions that do I/O block on a Tokio runtime of their own, which
//! is not allowed on our worker threads (they run the VM inside a Tokio runtime). Those are replaced:
//! `fd_write` to stdout/stderr goes synchronously to the gateway's stderr (stdout is reserved for the
//! `LISTENING`/`READY` lines), `fd_fdstat_get`/`fd_read`/`fd_seek`/`fd_close` answer for stdio, and the
//! other file-system calls return ENOSYS (the plugin gets no preopened directories anyway).
//! `path_open` returns ENOENT, as proxy-wasm-cpp-host's. A WASI import that wasmtime-wasi does not
//! have refuses the module (missing import), as in Envoy.

use super::HostState;
use std::io::Write;
use wasmtime::{Caller, Linker};

/// wasmtime-wasi functions that would block on an inner runtime.
const BLOCKING: &[&str] = &[
    "fd_advise",
    "fd_close",
    "fd_datasync",
    "fd_fdstat_get",
    "fd_filestat_get",
    "fd_filestat_set_size",
    "fd_filestat_set_times",
    "fd_read",
    "fd_pread",
    "fd_seek",
    "fd_sync",
    "fd_readdir",
    "fd_write",
    "fd_pwrite",
    "poll_oneoff",
    "path_create_directory",
    "path_filestat_get",
    "path_filestat_set_times",
    "path_link",
    "path_open",
    "path_readlink",
    "path_remove_directory",
    "path_rename",
    "path_symlink",
    "path_unlink_file",
    "fd_renumber",
];

/// Replaced here with synchronous versions.
const OURS: &[&str] = &["fd_write", "fd_fdstat_get", "fd_read", "fd_seek", "fd_close"];

const EBADF: i32 = 8;
const ESPIPE: i32 = 70;
const EFAULT: i32 = 21;

/// True if the WASI import `name` is provided safely (by wasmtime-wasi or by us).
pub fn provided(name: &str) -> bool {
    !BLOCKING.contains(&name) || OURS.contains(&name)
}

fn mem(c: &mut Caller<'_, HostState>) -> Option<wasmtime::Memory> {
    c.data().exports.memory
}

fn rd_u32(data: &[u8], at: usize) -> Option<u32> {
    data.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes)
}

/// Add wasmtime-wasi p1 and our replacements (both module names).
pub fn add(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    wasmtime_wasi::p1::add_to_linker_sync(linker, |s: &mut HostState| &mut s.wasi)
        .map_err(super::werr)?;
    linker.allow_shadowing(true);
    for m in ["wasi_snapshot_preview1", "wasi_unstable"] {
        linker
            .func_wrap(
                m,
                "fd_write",
                |mut c: Caller<'_, HostState>, fd: i32, iovs: i32, n: i32, out: i32| -> i32 {
                    if fd != 1 && fd != 2 {
                        return EBADF;
                    }
                    let Some(memory) = mem(&mut c) else { return EFAULT };
                    let data = memory.data(&c);
                    let mut buf = Vec::new();
                    for i in 0..(n as u32 as usize) {
                        let at = iovs as u32 as usize + i * 8;
                        let (Some(p), Some(l)) = (rd_u32(data, at), rd_u32(data, at + 4)) else {
                            return EFAULT;
                        };
                        let Some(s) = data.get(p as usize..p as usize + l as usize) else {
                            return EFAULT;
                        };
                        buf.extend_from_slice(s);
                    }
                    let _ = std::io::stderr().write_all(&buf);
                    let len = (buf.len() as u32).to_le_bytes();
                    match memory
                        .data_mut(&mut c)
                        .get_mut(out as u32 as usize..out as u32 as usize + 4)
                    {
                        Some(d) => {
                            d.copy_from_slice(&len);
                            0
                        }
                        None => EFAULT,
                    }
                },
            )
            .map_err(super::werr)?;
        linker
            .func_wrap(
                m,
                "fd_fdstat_get",
                |mut c: Caller<'_, HostState>, fd: i32, out: i32| -> i32 {
                    if !(0..=2).contains(&fd) {
                        return EBADF;
                    }
                    let Some(memory) = mem(&mut c) else { return EFAULT };
                    let mut stat = [0u8; 24];
                    stat[0] = 2; // character device
                    stat[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
                    match memory
                        .data_mut(&mut c)
                        .get_mut(out as u32 as usize..out as u32 as usize + 24)
                    {
                        Some(d) => {
                            d.copy_from_slice(&stat);
                            0
                        }
                        None => EFAULT,
                    }
                },
            )
            .map_err(super::werr)?;
        linker
            .func_wrap(
                m,
                "fd_read",
                |mut c: Caller<'_, HostState>, fd: i32, _iovs: i32, _n: i32, out: i32| -> i32 {
                    if fd != 0 {
                        return EBADF;
                    }
                    // stdin is empty.
                    let Some(memory) = mem(&mut c) else { return EFAULT };
                    match memory
                        .data_mut(&mut c)
                        .get_mut(out as u32 as usize..out as u32 as usize + 4)
                    {
                        Some(d) => {
                            d.copy_from_slice(&[0; 4]);
                            0
                        }
                        None => EFAULT,
                    }
                },
            )
            .map_err(super::werr)?;
        linker
            .func_wrap(
                m,
                "fd_seek",
                |_c: Caller<'_, HostState>, fd: i32, _off: i64, _wh: i32, _out: i32| -> i32 {
                    if (0..=2).contains(&fd) {
                        ESPIPE
                    } else {
                        EBADF
                    }
                },
            )
            .map_err(super::werr)?;
        linker
            .func_wrap(m, "fd_close", |_c: Caller<'_, HostState>, _fd: i32| -> i32 { EBADF })
            .map_err(super::werr)?;
    }
    Ok(())
}
