//! The kernel side of fusestate's passthrough front end.
//!
//! `fuser` speaks the FUSE protocol on `/dev/fuse` in a thread of its own. Each request it
//! parses is queued here with its reply handle, and an eventfd wakes the daemon's trio loop,
//! which takes the queued requests as tuples, answers them in its own tasks, and replies
//! through the methods of [`Session`]. Nothing here knows the file system: it moves requests
//! and replies, and it registers backing files for FUSE passthrough (a file's reads and writes
//! served by the kernel from a local file, never reaching the daemon).

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackgroundSession, BackingId, Config, Errno, FileAttr, FileHandle, FileType, FopenFlags,
    Filesystem, Generation, INodeNo, InitFlags, KernelConfig, LockOwner,
    Notifier, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, SessionACL,
    TimeOrNow, WriteFlags,
};
use pyo3::exceptions::{PyKeyError, PyOSError, PyRuntimeError};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// What the daemon asks of the connection at INIT.
#[derive(Clone, Copy)]
struct Wishes {
    writeback_cache: bool,
    passthrough: bool,
    max_readahead: u32,
    max_background: u16,
}

/// What the kernel agreed to at INIT.
#[derive(Clone, Copy, Default)]
struct Agreed {
    done: bool,
    writeback_cache: bool,
    passthrough: bool,
    passthrough_offered: bool,
    abi_major: u32,
    abi_minor: u32,
}

/// A request's arguments, as the daemon's handlers take them.
enum Op {
    Lookup { parent: u64, name: Vec<u8> },
    Forget { items: Vec<(u64, u64)> },
    Getattr { ino: u64 },
    Setattr {
        ino: u64,
        fh: Option<u64>,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime_ns: Option<i64>,
        mtime_ns: Option<i64>,
    },
    Readlink { ino: u64 },
    Mknod { parent: u64, name: Vec<u8>, mode: u32, rdev: u32 },
    Mkdir { parent: u64, name: Vec<u8>, mode: u32 },
    Unlink { parent: u64, name: Vec<u8> },
    Rmdir { parent: u64, name: Vec<u8> },
    Symlink { parent: u64, name: Vec<u8>, target: Vec<u8> },
    Rename { parent: u64, name: Vec<u8>, newparent: u64, newname: Vec<u8>, flags: u32 },
    Link { ino: u64, newparent: u64, newname: Vec<u8> },
    Open { ino: u64, flags: i32 },
    Create { parent: u64, name: Vec<u8>, mode: u32, flags: i32 },
    Read { fh: u64, offset: u64, size: u32 },
    Write { fh: u64, offset: u64, data: Vec<u8> },
    Flush { fh: u64 },
    Release { ino: u64, fh: u64 },
    Fsync { fh: u64, datasync: bool },
    Opendir { ino: u64 },
    Readdirplus { fh: u64, offset: u64 },
    Releasedir { fh: u64 },
    Fsyncdir { fh: u64, datasync: bool },
    Statfs,
    Setxattr { ino: u64, name: Vec<u8>, value: Vec<u8> },
    Getxattr { ino: u64, name: Vec<u8>, size: u32 },
    Listxattr { ino: u64, size: u32 },
    Removexattr { ino: u64, name: Vec<u8> },
}

/// A reply handle waiting for the daemon's answer.
enum Pending {
    Entry(ReplyEntry),
    Attr(ReplyAttr),
    Empty(ReplyEmpty),
    Data(ReplyData),
    Open(ReplyOpen),
    Create(ReplyCreate),
    Write(ReplyWrite),
    Statfs(ReplyStatfs),
    DirPlus(ReplyDirectoryPlus),
    Xattr(ReplyXattr),
}

impl Pending {
    fn error(self, err: Errno) {
        match self {
            Pending::Entry(r) => r.error(err),
            Pending::Attr(r) => r.error(err),
            Pending::Empty(r) => r.error(err),
            Pending::Data(r) => r.error(err),
            Pending::Open(r) => r.error(err),
            Pending::Create(r) => r.error(err),
            Pending::Write(r) => r.error(err),
            Pending::Statfs(r) => r.error(err),
            Pending::DirPlus(r) => r.error(err),
            Pending::Xattr(r) => r.error(err),
        }
    }
}

struct Queued {
    id: u64,
    uid: u32,
    gid: u32,
    pid: u32,
    op: Op,
}

/// One inode's backing file: the kernel wants the same backing id for every open of an inode
/// while any passthrough open of it lasts.
struct Backing {
    id: BackingId,
    opens: u64,
}

/// State shared by fuser's thread and the daemon's calls.
struct Shared {
    wishes: Wishes,
    agreed: Mutex<Agreed>,
    queue: Mutex<VecDeque<Queued>>,
    replies: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    ended: AtomicBool,
    event_fd: RawFd,
    // Passthrough opens: the backing id of each inode, and the inode of each handle.
    backings: Mutex<HashMap<u64, Backing>>,
    passthrough_handles: Mutex<HashMap<u64, u64>>,
    passthrough_opens: AtomicU64,
    passthrough_refused: AtomicU64,
}

impl Shared {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our own eventfd.
        unsafe { libc::write(self.event_fd, &one as *const u64 as *const libc::c_void, 8) };
    }

    fn push(&self, req: &Request, op: Op, reply: Option<Pending>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Some(reply) = reply {
            self.replies.lock().unwrap().insert(id, reply);
        }
        let queued = Queued { id, uid: req.uid(), gid: req.gid(), pid: req.pid(), op };
        let was_empty = {
            let mut queue = self.queue.lock().unwrap();
            queue.push_back(queued);
            queue.len() == 1
        };
        if was_empty {
            self.wake();
        }
    }

    fn take_reply(&self, id: u64) -> PyResult<Pending> {
        self.replies
            .lock()
            .unwrap()
            .remove(&id)
            .ok_or_else(|| PyKeyError::new_err(format!("no request {id} waits for a reply")))
    }

    /// A handle's passthrough open ended: the inode's backing id goes with its last open.
    fn released(&self, fh: u64) {
        let Some(ino) = self.passthrough_handles.lock().unwrap().remove(&fh) else { return };
        let mut backings = self.backings.lock().unwrap();
        if let Some(b) = backings.get_mut(&ino) {
            b.opens -= 1;
            if b.opens == 0 {
                backings.remove(&ino); // dropping the id closes it in the kernel
            }
        }
    }
}

/// fuser's side: every request goes to the queue; nothing is answered here.
struct Bridge {
    shared: Arc<Shared>,
}

fn name_of(name: &OsStr) -> Vec<u8> {
    name.as_bytes().to_vec()
}

fn time_ns(t: TimeOrNow) -> i64 {
    let t = match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    };
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

impl Filesystem for Bridge {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let w = self.shared.wishes;
        let offered = config.capabilities();
        let mut want = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_AUTO_INVAL_DATA
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_EXPORT_SUPPORT;
        let passthrough = w.passthrough && offered.contains(InitFlags::FUSE_PASSTHROUGH);
        if passthrough {
            want |= InitFlags::FUSE_PASSTHROUGH;
            let _ = config.set_max_stack_depth(1);
        }
        // The kernel refuses passthrough on a connection with the writeback cache.
        let writeback = w.writeback_cache && !passthrough;
        if writeback {
            want |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        let _ = config.add_capabilities(want & offered);
        if w.max_readahead > 0 {
            let _ = config.set_max_readahead(w.max_readahead);
        }
        if w.max_background > 0 {
            let _ = config.set_max_background(w.max_background);
        }
        let abi = config.kernel_abi();
        *self.shared.agreed.lock().unwrap() = Agreed {
            done: true,
            writeback_cache: writeback && offered.contains(InitFlags::FUSE_WRITEBACK_CACHE),
            passthrough,
            passthrough_offered: offered.contains(InitFlags::FUSE_PASSTHROUGH),
            abi_major: abi.0,
            abi_minor: abi.1,
        };
        Ok(())
    }

    fn destroy(&mut self) {
        self.shared.ended.store(true, Ordering::SeqCst);
        self.shared.wake();
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.shared.push(req, Op::Lookup { parent: parent.0, name: name_of(name) }, Some(Pending::Entry(reply)));
    }

    fn forget(&self, req: &Request, ino: INodeNo, nlookup: u64) {
        self.shared.push(req, Op::Forget { items: vec![(ino.0, nlookup)] }, None);
    }


    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.shared.push(req, Op::Getattr { ino: ino.0 }, Some(Pending::Attr(reply)));
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let op = Op::Setattr {
            ino: ino.0,
            fh: fh.map(|f| f.0),
            mode,
            uid,
            gid,
            size,
            atime_ns: atime.map(time_ns),
            mtime_ns: mtime.map(time_ns),
        };
        self.shared.push(req, op, Some(Pending::Attr(reply)));
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        self.shared.push(req, Op::Readlink { ino: ino.0 }, Some(Pending::Data(reply)));
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, rdev: u32, reply: ReplyEntry) {
        let op = Op::Mknod { parent: parent.0, name: name_of(name), mode, rdev };
        self.shared.push(req, op, Some(Pending::Entry(reply)));
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        let op = Op::Mkdir { parent: parent.0, name: name_of(name), mode };
        self.shared.push(req, op, Some(Pending::Entry(reply)));
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.shared.push(req, Op::Unlink { parent: parent.0, name: name_of(name) }, Some(Pending::Empty(reply)));
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.shared.push(req, Op::Rmdir { parent: parent.0, name: name_of(name) }, Some(Pending::Empty(reply)));
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let op = Op::Symlink {
            parent: parent.0,
            name: name_of(link_name),
            target: target.as_os_str().as_bytes().to_vec(),
        };
        self.shared.push(req, op, Some(Pending::Entry(reply)));
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let op = Op::Rename {
            parent: parent.0,
            name: name_of(name),
            newparent: newparent.0,
            newname: name_of(newname),
            flags: flags.bits(),
        };
        self.shared.push(req, op, Some(Pending::Empty(reply)));
    }

    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let op = Op::Link { ino: ino.0, newparent: newparent.0, newname: name_of(newname) };
        self.shared.push(req, op, Some(Pending::Entry(reply)));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.shared.push(req, Op::Open { ino: ino.0, flags: flags.0 }, Some(Pending::Open(reply)));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let op = Op::Create { parent: parent.0, name: name_of(name), mode, flags };
        self.shared.push(req, op, Some(Pending::Create(reply)));
    }

    fn read(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.shared.push(req, Op::Read { fh: fh.0, offset, size }, Some(Pending::Data(reply)));
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let op = Op::Write { fh: fh.0, offset, data: data.to_vec() };
        self.shared.push(req, op, Some(Pending::Write(reply)));
    }

    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        self.shared.push(req, Op::Flush { fh: fh.0 }, Some(Pending::Empty(reply)));
    }

    fn release(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The kernel has let go of the file: its backing id may go with its inode's last open.
        self.shared.released(fh.0);
        self.shared.push(req, Op::Release { ino: ino.0, fh: fh.0 }, Some(Pending::Empty(reply)));
    }

    fn fsync(&self, req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        self.shared.push(req, Op::Fsync { fh: fh.0, datasync }, Some(Pending::Empty(reply)));
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.shared.push(req, Op::Opendir { ino: ino.0 }, Some(Pending::Open(reply)));
    }

    fn readdirplus(&self, req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, reply: ReplyDirectoryPlus) {
        self.shared.push(req, Op::Readdirplus { fh: fh.0, offset }, Some(Pending::DirPlus(reply)));
    }

    fn releasedir(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        self.shared.push(req, Op::Releasedir { fh: fh.0 }, Some(Pending::Empty(reply)));
    }

    fn fsyncdir(&self, req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        self.shared.push(req, Op::Fsyncdir { fh: fh.0, datasync }, Some(Pending::Empty(reply)));
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.shared.push(req, Op::Statfs, Some(Pending::Statfs(reply)));
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let op = Op::Setxattr { ino: ino.0, name: name_of(name), value: value.to_vec() };
        self.shared.push(req, op, Some(Pending::Empty(reply)));
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let op = Op::Getxattr { ino: ino.0, name: name_of(name), size };
        self.shared.push(req, op, Some(Pending::Xattr(reply)));
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.shared.push(req, Op::Listxattr { ino: ino.0, size }, Some(Pending::Xattr(reply)));
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let op = Op::Removexattr { ino: ino.0, name: name_of(name) };
        self.shared.push(req, op, Some(Pending::Empty(reply)));
    }
}

// --- attributes from the daemon -------------------------------------------------------------

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn system_time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

fn seconds(value: f64) -> Duration {
    Duration::from_secs_f64(if value.is_finite() && value > 0.0 { value } else { 0.0 })
}

/// An entry's attributes, read from an object with pyfuse3's `EntryAttributes` field names.
struct Attributes {
    attr: FileAttr,
    attr_ttl: Duration,
    entry_ttl: Duration,
    generation: u64,
}

impl<'py> FromPyObject<'_, 'py> for Attributes {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let get_u64 = |name: &str| -> PyResult<u64> { obj.getattr(name)?.extract() };
        let get_i64 = |name: &str| -> PyResult<i64> { obj.getattr(name)?.extract() };
        let mode = get_u64("st_mode")? as u32;
        let attr = FileAttr {
            ino: INodeNo(get_u64("st_ino")?),
            size: get_u64("st_size")?,
            blocks: get_u64("st_blocks")?,
            atime: system_time(get_i64("st_atime_ns")?),
            mtime: system_time(get_i64("st_mtime_ns")?),
            ctime: system_time(get_i64("st_ctime_ns")?),
            crtime: UNIX_EPOCH,
            kind: kind_of(mode),
            perm: (mode & 0o7777) as u16,
            nlink: get_u64("st_nlink")? as u32,
            uid: get_u64("st_uid")? as u32,
            gid: get_u64("st_gid")? as u32,
            rdev: get_u64("st_rdev")? as u32,
            blksize: get_u64("st_blksize")? as u32,
            flags: 0,
        };
        Ok(Attributes {
            attr,
            attr_ttl: seconds(obj.getattr("attr_timeout")?.extract()?),
            entry_ttl: seconds(obj.getattr("entry_timeout")?.extract()?),
            generation: get_u64("generation")?,
        })
    }
}

fn errno(value: i32) -> Errno {
    Errno::from_i32(if value > 0 { value } else { libc::EIO })
}

fn open_flags(keep_cache: bool, direct_io: bool) -> FopenFlags {
    let mut flags = FopenFlags::empty();
    if keep_cache {
        flags |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if direct_io {
        flags |= FopenFlags::FOPEN_DIRECT_IO;
    }
    flags
}

// --- the Python object ----------------------------------------------------------------------

/// A mounted FUSE session. Create it, read ``event_fd`` when it is readable, ``take()`` the
/// waiting requests and answer each with one of the ``reply_*`` methods.
#[pyclass(module = "fusestate_kernel")]
struct Session {
    shared: Arc<Shared>,
    background: Mutex<Option<BackgroundSession>>,
    notifier: Notifier,
    invalidations: Mutex<Option<mpsc::Sender<(u64, Vec<u8>)>>>,
    mountpoint: String,
}

impl Session {
    /// Register ``fd`` (or reuse the inode's registered backing file) for a passthrough open.
    fn backing_for<F>(&self, ino: u64, fh: u64, fd: RawFd, register: F) -> io::Result<()>
    where
        F: FnOnce(BorrowedFd<'_>) -> io::Result<BackingId>,
    {
        let mut backings = self.shared.backings.lock().unwrap();
        match backings.get_mut(&ino) {
            Some(b) => b.opens += 1,
            None => {
                // SAFETY: the caller keeps fd open for the duration of this call.
                let id = register(unsafe { BorrowedFd::borrow_raw(fd) })?;
                backings.insert(ino, Backing { id, opens: 1 });
            }
        }
        self.shared.passthrough_handles.lock().unwrap().insert(fh, ino);
        Ok(())
    }
}

fn request_tuple<'py>(py: Python<'py>, q: Queued) -> PyResult<Bound<'py, PyTuple>> {
    let head = (q.id, q.uid, q.gid, q.pid);
    let b = |v: &[u8]| PyBytes::new(py, v);
    let t = match q.op {
        Op::Lookup { parent, name } => (head, "lookup", (parent, b(&name))).into_pyobject(py)?,
        Op::Forget { items } => (head, "forget", (items,)).into_pyobject(py)?,
        Op::Getattr { ino } => (head, "getattr", (ino,)).into_pyobject(py)?,
        Op::Setattr { ino, fh, mode, uid, gid, size, atime_ns, mtime_ns } => {
            (head, "setattr", (ino, fh, mode, uid, gid, size, atime_ns, mtime_ns)).into_pyobject(py)?
        }
        Op::Readlink { ino } => (head, "readlink", (ino,)).into_pyobject(py)?,
        Op::Mknod { parent, name, mode, rdev } => (head, "mknod", (parent, b(&name), mode, rdev)).into_pyobject(py)?,
        Op::Mkdir { parent, name, mode } => (head, "mkdir", (parent, b(&name), mode)).into_pyobject(py)?,
        Op::Unlink { parent, name } => (head, "unlink", (parent, b(&name))).into_pyobject(py)?,
        Op::Rmdir { parent, name } => (head, "rmdir", (parent, b(&name))).into_pyobject(py)?,
        Op::Symlink { parent, name, target } => (head, "symlink", (parent, b(&name), b(&target))).into_pyobject(py)?,
        Op::Rename { parent, name, newparent, newname, flags } => {
            (head, "rename", (parent, b(&name), newparent, b(&newname), flags)).into_pyobject(py)?
        }
        Op::Link { ino, newparent, newname } => (head, "link", (ino, newparent, b(&newname))).into_pyobject(py)?,
        Op::Open { ino, flags } => (head, "open", (ino, flags)).into_pyobject(py)?,
        Op::Create { parent, name, mode, flags } => (head, "create", (parent, b(&name), mode, flags)).into_pyobject(py)?,
        Op::Read { fh, offset, size } => (head, "read", (fh, offset, size)).into_pyobject(py)?,
        Op::Write { fh, offset, data } => (head, "write", (fh, offset, b(&data))).into_pyobject(py)?,
        Op::Flush { fh } => (head, "flush", (fh,)).into_pyobject(py)?,
        Op::Release { ino, fh } => (head, "release", (ino, fh)).into_pyobject(py)?,
        Op::Fsync { fh, datasync } => (head, "fsync", (fh, datasync)).into_pyobject(py)?,
        Op::Opendir { ino } => (head, "opendir", (ino,)).into_pyobject(py)?,
        Op::Readdirplus { fh, offset } => (head, "readdirplus", (fh, offset)).into_pyobject(py)?,
        Op::Releasedir { fh } => (head, "releasedir", (fh,)).into_pyobject(py)?,
        Op::Fsyncdir { fh, datasync } => (head, "fsyncdir", (fh, datasync)).into_pyobject(py)?,
        Op::Statfs => (head, "statfs", ()).into_pyobject(py)?,
        Op::Setxattr { ino, name, value } => (head, "setxattr", (ino, b(&name), b(&value))).into_pyobject(py)?,
        Op::Getxattr { ino, name, size } => (head, "getxattr", (ino, b(&name), size)).into_pyobject(py)?,
        Op::Listxattr { ino, size } => (head, "listxattr", (ino, size)).into_pyobject(py)?,
        Op::Removexattr { ino, name } => (head, "removexattr", (ino, b(&name))).into_pyobject(py)?,
    };
    Ok(t)
}

/// How to mount: the source and type `/proc/mounts` shows, the mount flags, the kernel's own
/// options, and whether other users may enter.
struct MountPlan {
    source: String,
    fstype: String,
    flags: libc::c_ulong,
    data: Vec<String>,
    allow_other: bool,
}

fn mount_plan(options: &[String]) -> MountPlan {
    let mut plan = MountPlan {
        source: "fusestate".into(),
        fstype: "fuse".into(),
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: Vec::new(),
        allow_other: false,
    };
    for o in options {
        match o.as_str() {
            "allow_other" => {
                plan.allow_other = true;
                plan.data.push(o.clone());
            }
            "ro" => plan.flags |= libc::MS_RDONLY,
            "rw" => plan.flags &= !libc::MS_RDONLY,
            "noatime" => plan.flags |= libc::MS_NOATIME,
            "nodev" => plan.flags |= libc::MS_NODEV,
            "nosuid" => plan.flags |= libc::MS_NOSUID,
            "noexec" => plan.flags |= libc::MS_NOEXEC,
            "dirsync" => plan.flags |= libc::MS_DIRSYNC,
            "debug" => {}
            x if x.starts_with("fsname=") => plan.source = x[7..].to_string(),
            x if x.starts_with("subtype=") => plan.fstype = format!("fuse.{}", &x[8..]),
            _ => plan.data.push(o.clone()),
        }
    }
    plan
}

fn c_string(s: &str) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("NUL in {s:?}")))
}

/// Open `/dev/fuse` and mount it on `mountpoint` (mount(2): the daemon runs with
/// CAP_SYS_ADMIN, as passthrough needs anyway).
fn mount_fuse(mountpoint: &str, plan: &MountPlan) -> io::Result<OwnedFd> {
    let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?;
    let fd: OwnedFd = dev.into();
    let mut data = vec![
        format!("fd={}", fd.as_raw_fd()),
        "rootmode=40000".to_string(),
        // SAFETY: plain getters.
        format!("user_id={}", unsafe { libc::geteuid() }),
        format!("group_id={}", unsafe { libc::getegid() }),
    ];
    data.extend(plan.data.iter().cloned());
    let (source, target, fstype, data) =
        (c_string(&plan.source)?, c_string(mountpoint)?, c_string(&plan.fstype)?, c_string(&data.join(","))?);
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), plan.flags, data.as_ptr() as *const libc::c_void)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Detach the mount (it may be gone already: then nothing happens).
fn detach(mountpoint: &str) {
    if let Ok(target) = c_string(mountpoint) {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

#[pymethods]
impl Session {
    /// Mount ``mountpoint`` and agree on the connection's features with the kernel.
    #[new]
    #[pyo3(signature = (mountpoint, options, *, writeback_cache=true, passthrough=false, max_readahead=0, max_background=0))]
    fn new(
        py: Python<'_>,
        mountpoint: String,
        options: Vec<String>,
        writeback_cache: bool,
        passthrough: bool,
        max_readahead: u32,
        max_background: u16,
    ) -> PyResult<Self> {
        // SAFETY: eventfd with flags only.
        let event_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if event_fd < 0 {
            return Err(PyOSError::new_err(io::Error::last_os_error().to_string()));
        }
        let shared = Arc::new(Shared {
            wishes: Wishes { writeback_cache, passthrough, max_readahead, max_background },
            agreed: Mutex::new(Agreed::default()),
            queue: Mutex::new(VecDeque::new()),
            replies: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            ended: AtomicBool::new(false),
            event_fd,
            backings: Mutex::new(HashMap::new()),
            passthrough_handles: Mutex::new(HashMap::new()),
            passthrough_opens: AtomicU64::new(0),
            passthrough_refused: AtomicU64::new(0),
        });
        let plan = mount_plan(&options);
        let acl = if plan.allow_other { SessionACL::All } else { SessionACL::Owner };
        let bridge = Bridge { shared: shared.clone() };
        let mp = mountpoint.clone();
        let session = py
            .detach(move || -> io::Result<fuser::Session<Bridge>> {
                let fd = mount_fuse(&mp, &plan)?;
                fuser::Session::from_fd(bridge, fd, acl, Config::default()).inspect_err(|_| detach(&mp))
            })
            .map_err(|e| {
                // SAFETY: our eventfd, closed once.
                unsafe { libc::close(event_fd) };
                PyRuntimeError::new_err(e.to_string())
            })?;
        let notifier = session.notifier();
        let background = session.spawn().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        // Entry invalidations wait for the kernel, which may wait for a request this daemon
        // answers: they go out from a thread of their own.
        let (tx, rx) = mpsc::channel::<(u64, Vec<u8>)>();
        let inval = background.notifier();
        thread::Builder::new()
            .name("fusestate-inval".into())
            .spawn(move || {
                for (parent, name) in rx {
                    let _ = inval.inval_entry(INodeNo(parent), OsStr::from_bytes(&name));
                }
            })
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Session {
            shared,
            background: Mutex::new(Some(background)),
            notifier,
            invalidations: Mutex::new(Some(tx)),
            mountpoint,
        })
    }

    /// The descriptor that becomes readable when requests wait (an eventfd).
    #[getter]
    fn event_fd(&self) -> RawFd {
        self.shared.event_fd
    }

    #[getter]
    fn mountpoint(&self) -> &str {
        &self.mountpoint
    }

    /// What the kernel agreed to at INIT.
    fn agreed(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let a = *self.shared.agreed.lock().unwrap();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("writeback_cache", a.writeback_cache)?;
        d.set_item("passthrough", a.passthrough)?;
        d.set_item("passthrough_offered", a.passthrough_offered)?;
        d.set_item("abi", format!("{}.{}", a.abi_major, a.abi_minor))?;
        d.set_item("initialized", a.done)?;
        Ok(d.into_any().unbind())
    }

    /// Passthrough counters: opens handed to a backing file, registrations the kernel
    /// refused, backing files registered now.
    fn passthrough_stats(&self) -> (u64, u64, usize) {
        (
            self.shared.passthrough_opens.load(Ordering::Relaxed),
            self.shared.passthrough_refused.load(Ordering::Relaxed),
            self.shared.backings.lock().unwrap().len(),
        )
    }

    /// The requests waiting now, as ``((id, uid, gid, pid), op, args)``; None once the
    /// session has ended and nothing waits.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let mut counter: u64 = 0;
        // SAFETY: reading 8 bytes from our own non-blocking eventfd (EAGAIN when not set).
        unsafe { libc::read(self.shared.event_fd, &mut counter as *mut u64 as *mut libc::c_void, 8) };
        let drained: Vec<Queued> = self.shared.queue.lock().unwrap().drain(..).collect();
        if drained.is_empty() && self.shared.ended.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let list = PyList::empty(py);
        for q in drained {
            list.append(request_tuple(py, q)?)?;
        }
        Ok(Some(list))
    }

    fn reply_error(&self, id: u64, err: i32) -> PyResult<()> {
        self.shared.take_reply(id)?.error(errno(err));
        Ok(())
    }

    fn reply_ok(&self, id: u64) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Empty(r) => r.ok(),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    fn reply_entry(&self, id: u64, attrs: Attributes) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Entry(r) => r.entry_with_ttls(&attrs.attr_ttl, &attrs.entry_ttl, &attrs.attr, Generation(attrs.generation)),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    fn reply_attr(&self, id: u64, attrs: Attributes) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Attr(r) => r.attr(&attrs.attr_ttl, &attrs.attr),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    fn reply_data(&self, id: u64, data: &[u8]) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Data(r) => r.data(data),
            Pending::Xattr(r) => r.data(data),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    fn reply_xattr_size(&self, id: u64, size: u32) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Xattr(r) => r.size(size),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    fn reply_write(&self, id: u64, written: u32) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Write(r) => r.written(written),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    /// Answer an open (or opendir). With ``backing_fd`` (a file this daemon holds open) the
    /// kernel serves the file's reads and writes from it; returns whether it does. A backing
    /// file the kernel refuses leaves the open to the daemon (False). The kernel takes no
    /// page-cache flag (``keep_cache``) with a backing file: its own pages serve the file.
    #[pyo3(signature = (id, ino, fh, keep_cache=false, direct_io=false, backing_fd=None))]
    fn reply_open(&self, id: u64, ino: u64, fh: u64, keep_cache: bool, direct_io: bool, backing_fd: Option<RawFd>) -> PyResult<bool> {
        // The kernel takes no page-cache flag with passthrough: the backing file has the pages.
        let flags = open_flags(keep_cache, direct_io);
        match self.shared.take_reply(id)? {
            Pending::Open(r) => {
                if let Some(fd) = backing_fd {
                    match self.backing_for(ino, fh, fd, |fd| r.open_backing(fd)) {
                        Ok(()) => {
                            let backings = self.shared.backings.lock().unwrap();
                            r.opened_passthrough(FileHandle(fh), open_flags(false, direct_io), &backings[&ino].id);
                            self.shared.passthrough_opens.fetch_add(1, Ordering::Relaxed);
                            return Ok(true);
                        }
                        Err(_) => {
                            self.shared.passthrough_refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                r.opened(FileHandle(fh), flags);
            }
            other => other.error(errno(libc::EIO)),
        }
        Ok(false)
    }

    /// Answer a create: the new entry and its open handle (passthrough as in ``reply_open``).
    #[pyo3(signature = (id, attrs, fh, keep_cache=false, direct_io=false, backing_fd=None))]
    fn reply_create(&self, id: u64, attrs: Attributes, fh: u64, keep_cache: bool, direct_io: bool, backing_fd: Option<RawFd>) -> PyResult<bool> {
        let flags = open_flags(keep_cache, direct_io);
        let generation = Generation(attrs.generation);
        match self.shared.take_reply(id)? {
            Pending::Create(r) => {
                if let Some(fd) = backing_fd {
                    match self.backing_for(attrs.attr.ino.0, fh, fd, |fd| r.open_backing(fd)) {
                        Ok(()) => {
                            let backings = self.shared.backings.lock().unwrap();
                            let id = &backings[&attrs.attr.ino.0].id;
                            let flags = open_flags(false, direct_io);
                            r.created_passthrough(&attrs.entry_ttl, &attrs.attr, generation, FileHandle(fh), flags, id);
                            self.shared.passthrough_opens.fetch_add(1, Ordering::Relaxed);
                            return Ok(true);
                        }
                        Err(_) => {
                            self.shared.passthrough_refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                r.created(&attrs.entry_ttl, &attrs.attr, generation, FileHandle(fh), flags);
            }
            other => other.error(errno(libc::EIO)),
        }
        Ok(false)
    }

    #[allow(clippy::too_many_arguments)]
    fn reply_statfs(&self, id: u64, blocks: u64, bfree: u64, bavail: u64, files: u64, ffree: u64, bsize: u32, namelen: u32, frsize: u32) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::Statfs(r) => r.statfs(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    /// Add one entry to a directory listing's reply; False when it no longer fits (the entry
    /// is not in the reply).
    fn dir_add(&self, id: u64, name: &[u8], attrs: Attributes, next_offset: u64) -> PyResult<bool> {
        let mut replies = self.shared.replies.lock().unwrap();
        match replies.get_mut(&id) {
            Some(Pending::DirPlus(r)) => {
                let full = r.add(attrs.attr.ino, next_offset, OsStr::from_bytes(name), &attrs.entry_ttl, &attrs.attr, Generation(attrs.generation));
                Ok(!full)
            }
            _ => Err(PyKeyError::new_err(format!("no listing {id} waits for entries"))),
        }
    }

    /// Send a directory listing's reply with the entries added.
    fn reply_dir(&self, id: u64) -> PyResult<()> {
        match self.shared.take_reply(id)? {
            Pending::DirPlus(r) => r.ok(),
            other => other.error(errno(libc::EIO)),
        }
        Ok(())
    }

    /// Have the kernel drop its entry ``parent/name``; sent from a thread of its own.
    fn invalidate_entry(&self, parent: u64, name: Vec<u8>) {
        if let Some(tx) = self.invalidations.lock().unwrap().as_ref() {
            let _ = tx.send((parent, name));
        }
    }

    /// Put ``data`` into the kernel's page cache of inode ``ino`` at ``offset``.
    /// ``data`` is any contiguous buffer (bytes, a memoryview of a block): not copied here.
    fn notify_store(&self, py: Python<'_>, ino: u64, offset: u64, data: PyBuffer<u8>) -> PyResult<()> {
        if !data.is_c_contiguous() {
            return Err(pyo3::exceptions::PyValueError::new_err("notify_store needs a contiguous buffer"));
        }
        // SAFETY: a contiguous buffer the caller keeps alive (and unchanged) for this call.
        let bytes = unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.len_bytes()) };
        py.detach(|| self.notifier.store(INodeNo(ino), offset, bytes))
            .map_err(|e| PyOSError::new_err((e.raw_os_error().unwrap_or(libc::EIO), e.to_string())))
    }

    /// End the session: after an unmount, wait for fuser's thread; otherwise detach the
    /// mount and leave the thread to end with the kernel's connection.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.invalidations.lock().unwrap().take();
        let background = self.background.lock().unwrap().take();
        if self.shared.ended.load(Ordering::SeqCst) {
            if let Some(bg) = background {
                py.detach(move || bg.join()).map_err(|e| PyOSError::new_err(e.to_string()))?;
            }
        } else {
            detach(&self.mountpoint);
        }
        Ok(())
    }

    /// Answer every request still waiting with an error (the daemon is going away).
    fn abandon(&self) {
        let waiting: Vec<Pending> = self.shared.replies.lock().unwrap().drain().map(|(_, r)| r).collect();
        for r in waiting {
            r.error(Errno::from_i32(libc::EIO));
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: our eventfd, closed once.
        unsafe { libc::close(self.shared.event_fd) };
    }
}

#[pymodule]
fn fusestate_kernel(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Session>()?;
    Ok(())
}
