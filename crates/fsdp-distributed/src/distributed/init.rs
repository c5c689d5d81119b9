//! `torch.distributed.init_process_group` and the default group of each rank.
//!
//! The backend is chosen in [`InitOptions::resolve`] (`threads`, `tcp`/`gloo`; `nccl` is
//! reserved) and the world is built in [`init_process_group`].
//!
//! On the `tcp` backend ([`TcpGroup`]) a rank is usually a process (as torchrun starts
//! them), though threads work too: rank 0 hosts a TCP store at `MASTER_ADDR:MASTER_PORT`,
//! and the ranks connect a mesh of TCP streams through it.
//!
//! On the `threads` backend a rank is a thread. `N` threads that call
//! [`init_process_group`] with the same rendezvous key (`MASTER_ADDR:MASTER_PORT`, a
//! `tcp://HOST:PORT` init method, or an in-process name `threads://NAME`) and distinct ranks
//! `0..N` join one world, through a process-global registry of pending worlds. Each thread
//! then has its own default group (`group.WORLD`), read by [`get_rank`], [`get_world_size`]
//! and [`default_group`]; [`launch`](super::launch) sets it on the threads it starts.
//!
//! ```
//! use fsdp_distributed::distributed::{get_rank, get_world_size, init_process_group, InitOptions};
//!
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         std::thread::spawn(move || {
//!             // What torchrun would put in each process's environment.
//!             let opts = InitOptions::new("threads").with_env([
//!                 ("RANK", rank.to_string()),
//!                 ("WORLD_SIZE", "2".to_string()),
//!                 ("MASTER_ADDR", "doc-example".to_string()),
//!                 ("MASTER_PORT", "29500".to_string()),
//!             ]);
//!             init_process_group(opts)?;
//!             let out = (get_rank()?, get_world_size()?);
//!             fsdp_distributed::distributed::destroy_process_group()?;
//!             Ok::<_, fsdp_core::Error>(out)
//!         })
//!     })
//!     .collect();
//! for (r, h) in ranks.into_iter().enumerate() {
//!     assert_eq!(h.join().unwrap().unwrap(), (r, 2));
//! }
//! ```

use super::init_options::InitOptions;
use super::{Group, TcpGroup, ThreadsGroup};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::sync::Arc;

/// A default group, by backend: what leaving or failing it takes differs.
#[derive(Clone)]
enum Handle {
    Threads(Arc<ThreadsGroup>),
    Tcp(Arc<TcpGroup>),
    #[cfg(feature = "cuda")]
    Nccl(Arc<super::nccl::NcclGroup>),
}

impl Handle {
    fn group(&self) -> Group {
        match self {
            Handle::Threads(g) => g.clone(),
            Handle::Tcp(g) => g.clone(),
            #[cfg(feature = "cuda")]
            Handle::Nccl(g) => g.clone(),
        }
    }

    fn mark_exited(&self) {
        match self {
            Handle::Threads(g) => g.mark_exited(),
            Handle::Tcp(g) => g.mark_exited(),
            // NCCL peers see an exited rank as a communicator that stops progressing: the
            // watchdog times out naming it.
            #[cfg(feature = "cuda")]
            Handle::Nccl(_) => {}
        }
    }

    fn mark_failed(&self, reason: String) {
        match self {
            Handle::Threads(g) => g.mark_failed(reason),
            Handle::Tcp(g) => g.mark_failed(reason),
            #[cfg(feature = "cuda")]
            Handle::Nccl(g) => g.mark_failed(reason),
        }
    }
}

/// This thread's default group and where it came from.
struct DefaultGroup {
    group: Handle,
    local_rank: Option<usize>,
    local_world_size: Option<usize>,
    /// Marks the rank exited when dropped (a thread that ends without
    /// `destroy_process_group`); off under `launch`, which records the rank's outcome itself.
    exit_on_drop: bool,
}

impl Drop for DefaultGroup {
    fn drop(&mut self) {
        if self.exit_on_drop {
            self.group.mark_exited();
        }
    }
}

thread_local! {
    static DEFAULT: RefCell<Option<DefaultGroup>> = const { RefCell::new(None) };
}

/// Clears this thread's default group when dropped. Launch's own group is not marked
/// exited by that (launch records the rank's outcome itself); a group the closure made with
/// `init_process_group` and did not destroy is.
pub(super) struct DefaultGroupGuard(());

impl Drop for DefaultGroupGuard {
    fn drop(&mut self) {
        let old = DEFAULT.with(|d| d.borrow_mut().take());
        drop(old);
    }
}

/// Makes `group` this thread's default group until the guard drops (used by `launch`).
pub(super) fn set_default_for_launch(group: Arc<ThreadsGroup>) -> DefaultGroupGuard {
    let size = super::ProcessGroup::size(group.as_ref());
    let rank = super::ProcessGroup::rank(group.as_ref());
    DEFAULT.with(|d| {
        *d.borrow_mut() = Some(DefaultGroup {
            group: Handle::Threads(group),
            local_rank: Some(rank),
            local_world_size: Some(size),
            exit_on_drop: false,
        })
    });
    DefaultGroupGuard(())
}

/// `torch.distributed.init_process_group`: joins this thread to the world of
/// `opts.world_size` ranks that share its rendezvous key, as rank `opts.rank`, and makes
/// that world this thread's default group. Blocks until every rank has joined.
///
/// Returns the world group (the default group, torch's `group.WORLD`).
///
/// # Errors
/// Everything [`InitOptions::resolve`] reports; `InvalidArgument` when this thread already
/// has a default group (torch: "trying to initialize the default process group twice"),
/// when another thread joined with the same rank, or when ranks disagree on the world size;
/// `Timeout` naming the ranks that did not join within `opts.timeout`.
pub fn init_process_group(opts: InitOptions) -> Result<Group> {
    let rv = opts.resolve()?;
    if is_initialized() {
        crate::error::bail_arg!(
            "init_process_group: this thread's default process group is already initialized (rank {} of {}); call destroy_process_group first",
            get_rank()?,
            get_world_size()?
        );
    }
    let handle = match rv.backend {
        "tcp" => Handle::Tcp(TcpGroup::init(&rv)?),
        #[cfg(feature = "cuda")]
        "nccl" => Handle::Nccl(super::nccl::NcclGroup::init(&rv)?),
        _ => Handle::Threads(Arc::new(super::rendezvous::join(&rv)?)),
    };
    let group = handle.group();
    DEFAULT.with(|d| {
        *d.borrow_mut() = Some(DefaultGroup {
            group: handle,
            local_rank: rv.local_rank,
            local_world_size: rv.local_world_size,
            exit_on_drop: true,
        })
    });
    Ok(group)
}

fn with_default<T>(call: &'static str, f: impl FnOnce(&DefaultGroup) -> T) -> Result<T> {
    DEFAULT.with(|d| match d.borrow().as_ref() {
        Some(g) => Ok(f(g)),
        None => Err(Error::NotInitialized { call }),
    })
}

/// Whether this thread has a default group (`torch.distributed.is_initialized`).
pub fn is_initialized() -> bool {
    DEFAULT.with(|d| d.borrow().is_some())
}

/// This thread's default group, torch's `group.WORLD`.
///
/// # Errors
/// `NotInitialized` before [`init_process_group`] (or outside [`launch`](super::launch)).
pub fn default_group() -> Result<Group> {
    with_default("default_group", |g| g.group.group())
}

/// This rank in the default group (`torch.distributed.get_rank()`).
///
/// # Errors
/// `NotInitialized` without a default group.
pub fn get_rank() -> Result<usize> {
    with_default("get_rank", |g| g.group.group().rank())
}

/// Number of ranks in the default group (`torch.distributed.get_world_size()`).
///
/// # Errors
/// `NotInitialized` without a default group.
pub fn get_world_size() -> Result<usize> {
    with_default("get_world_size", |g| g.group.group().size())
}

/// The default group's backend name (`torch.distributed.get_backend()`): `"threads"` or
/// `"tcp"`.
///
/// # Errors
/// `NotInitialized` without a default group.
pub fn get_backend() -> Result<&'static str> {
    with_default("get_backend", |g| g.group.group().backend())
}

/// This rank's index within its node (`torch.distributed.get_node_local_rank`): the
/// `local_rank` given to [`init_process_group`] (or `LOCAL_RANK`); under
/// [`launch`](super::launch), one node, so the rank itself.
///
/// # Errors
/// `NotInitialized` without a default group; `InvalidArgument` when the local rank was
/// neither given nor in the environment.
pub fn get_node_local_rank() -> Result<usize> {
    with_default("get_node_local_rank", |g| g.local_rank)?.ok_or_else(|| {
        Error::InvalidArgument(
            "get_node_local_rank: no local rank was given to init_process_group and LOCAL_RANK was not set".into(),
        )
    })
}

/// Ranks on this node: `local_world_size` given to [`init_process_group`] (or
/// `LOCAL_WORLD_SIZE`); under [`launch`](super::launch), the world size.
///
/// # Errors
/// As [`get_node_local_rank`], for `LOCAL_WORLD_SIZE`.
pub fn get_local_world_size() -> Result<usize> {
    with_default("get_local_world_size", |g| g.local_world_size)?.ok_or_else(|| {
        Error::InvalidArgument(
            "get_local_world_size: no local world size was given to init_process_group and LOCAL_WORLD_SIZE was not set".into(),
        )
    })
}

/// `torch.distributed.destroy_process_group()`: this rank leaves the default group's world.
/// Peers that wait for it in a collective of any group of that world fail at once with
/// `PeerFailed` naming it, instead of waiting out the timeout. This thread may then call
/// [`init_process_group`] again.
///
/// A rank thread that ends without calling it leaves the world the same way.
///
/// # Errors
/// `NotInitialized` without a default group.
pub fn destroy_process_group() -> Result<()> {
    let old = DEFAULT.with(|d| d.borrow_mut().take());
    match old {
        Some(mut g) => {
            g.exit_on_drop = false;
            g.group.mark_exited();
            Ok(())
        }
        None => Err(Error::NotInitialized {
            call: "destroy_process_group",
        }),
    }
}

/// Ends this thread's default group because this rank failed with `reason`: peers waiting
/// for it in any group of the world fail at once with `PeerFailed` naming it and carrying
/// `reason` (on the `tcp` backend the reason travels to the other processes). What a rank
/// process calls before it exits with an error. No-op without a default group.
pub fn abort_process_group(reason: &str) {
    let old = DEFAULT.with(|d| d.borrow_mut().take());
    if let Some(mut g) = old {
        g.exit_on_drop = false;
        g.group.mark_failed(reason.to_string());
    }
}
