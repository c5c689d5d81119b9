//! A point-to-point link with delay and loss, in user space: two TUN devices, one moved into
//! each namespace, and one thread per direction that reads each IP packet from one device
//! and writes it into the other `delay` later, dropping a fraction `loss` of them at random
//! (a fixed seed). The kernels on both sides see an ordinary interface, so TCP's own
//! retransmission repairs the losses as it would on a real link. It stands in for
//! `tc qdisc ... netem delay D loss L`, which this machine's kernel is built without
//! (`CONFIG_NET_SCH_NETEM` is not set; `tc` answers "Specified qdisc kind is unknown").

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A TUN device (layer 3, no packet information header) named `name` in this namespace.
fn open_tun(name: &str) -> Result<OwnedFd, String> {
    // SAFETY: open(2) of a constant, NUL-terminated path.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR) };
    if fd < 0 {
        return Err(format!("/dev/net/tun: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ifreq: a 16-byte name, then the union whose first member is the short flags.
    let mut req = [0u8; 40];
    if name.len() >= 16 {
        return Err(format!("{name}: an interface name is at most 15 bytes"));
    }
    req[..name.len()].copy_from_slice(name.as_bytes());
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as i16;
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes one struct ifreq (40 bytes on Linux).
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, req.as_mut_ptr()) } < 0 {
        return Err(format!(
            "TUNSETIFF {name}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(fd)
}

/// The forwarding threads of one link; dropped, they stop and the devices go away.
pub struct Wire {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Wire {
    /// Makes the TUN devices `names[0]` and `names[1]` and forwards between them with
    /// `delay` each way and `loss` (0..1) of the packets dropped. The caller moves each
    /// device into its namespace and gives it its address.
    pub fn new(names: [&str; 2], delay: Duration, loss: f64) -> Result<Wire, String> {
        let a = Arc::new(open_tun(names[0])?);
        let b = Arc::new(open_tun(names[1])?);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = [(a.clone(), b.clone(), 1u64), (b, a, 2u64)]
            .into_iter()
            .map(|(from, to, seed)| {
                let stop = stop.clone();
                std::thread::spawn(move || forward(&from, &to, delay, loss, seed, &stop))
            })
            .collect();
        Ok(Wire { stop, threads })
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// xorshift64*: a uniform draw in [0, 1).
fn uniform(state: &mut u64) -> f64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
}

/// Moves packets `from` -> `to`, each `delay` after it arrived, in arrival order.
fn forward(from: &OwnedFd, to: &OwnedFd, delay: Duration, loss: f64, seed: u64, stop: &AtomicBool) {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        while queue.front().is_some_and(|(due, _)| *due <= now) {
            let Some((_, p)) = queue.pop_front() else {
                break;
            };
            // SAFETY: writes p.len() initialized bytes; a down interface fails, and that
            // packet is lost as on a cut wire.
            let _ = unsafe { libc::write(to.as_raw_fd(), p.as_ptr().cast(), p.len()) };
        }
        let wait = queue
            .front()
            .map_or(Duration::from_millis(50), |(due, _)| {
                due.saturating_duration_since(now)
            })
            .min(Duration::from_millis(50));
        let mut pfd = libc::pollfd {
            fd: from.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // At least 1 ms: poll's timeout is in whole milliseconds.
        let ms = wait.as_millis().clamp(1, 50) as i32;
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            continue;
        }
        // SAFETY: reads at most buf.len() bytes into buf.
        let n = unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        if uniform(&mut rng) < loss {
            continue;
        }
        queue.push_back((Instant::now() + delay, buf[..n as usize].to_vec()));
    }
}
