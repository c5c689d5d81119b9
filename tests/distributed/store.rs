//! The TCP key-value store (`distributed::store`): c10d `TCPStore` semantics between client
//! threads (as separate processes would use it), timeouts that name the key and the rank,
//! bad bytes that give errors rather than panics, and clients that wait for a late server.

use crate::common;

use fsdp::distributed::{JobAuth, JobSecret, PrefixStore, Store, TcpStore, TcpStoreServer};
use fsdp::Error;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(20);

fn master() -> TcpStore {
    TcpStore::new("127.0.0.1", 0, 0, true, LONG).unwrap()
}

fn client(port: u16, rank: usize, timeout: Duration) -> TcpStore {
    TcpStore::new("127.0.0.1", port, rank, false, timeout).unwrap()
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn ranks_exchange_values_count_and_wait_through_the_store() {
    let m = master();
    let port = m.port();
    let n = 4;
    let got: Vec<(i64, Vec<Vec<u8>>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let st = client(port, r, LONG);
                    let ticket = st.add("joined", 1).unwrap();
                    st.set(
                        &format!("addr/{r}"),
                        format!("value of rank {r}").as_bytes(),
                    )
                    .unwrap();
                    let keys: Vec<String> = (0..n).map(|p| format!("addr/{p}")).collect();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    st.wait(&refs).unwrap();
                    assert!(st.check(&refs).unwrap());
                    let all = keys.iter().map(|k| st.get(k).unwrap()).collect();
                    (ticket, all)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut tickets: Vec<i64> = got.iter().map(|g| g.0).collect();
    tickets.sort_unstable();
    assert_eq!(tickets, vec![1, 2, 3, 4], "add is atomic across clients");
    for (_, all) in &got {
        for (p, v) in all.iter().enumerate() {
            assert_eq!(v, format!("value of rank {p}").as_bytes());
        }
    }
    // Counters read back as decimal text, as c10d's.
    assert_eq!(m.get("joined").unwrap(), b"4");
    assert_eq!(m.add("joined", -10).unwrap(), -6);
    assert_eq!(m.num_keys().unwrap(), n + 1);
    assert!(m.delete_key("addr/0").unwrap());
    assert!(!m.delete_key("addr/0").unwrap());
    assert!(!m.check(&["addr/0", "addr/1"]).unwrap());
    assert_eq!(m.num_keys().unwrap(), n);
    // Empty values, binary values and replacing a value.
    m.set("empty", b"").unwrap();
    assert_eq!(m.get("empty").unwrap(), b"");
    let id: Vec<u8> = (0..128u32).map(|i| (i * 37 % 256) as u8).collect();
    m.set("nccl_id", &id).unwrap();
    assert_eq!(client(port, 1, LONG).get("nccl_id").unwrap(), id);
    m.set("nccl_id", b"new").unwrap();
    assert_eq!(m.get("nccl_id").unwrap(), b"new");
}

#[test]
fn get_waits_for_a_key_set_later_by_another_rank() {
    let m = master();
    let port = m.port();
    let waiter = std::thread::spawn(move || client(port, 1, LONG).get("late"));
    let other = std::thread::spawn(move || {
        client(port, 2, LONG).wait(&["late", "later"])?;
        Ok::<_, Error>(())
    });
    // Both are blocked in the server until the keys appear, whenever that is.
    m.set("late", b"here").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), b"here");
    m.set("later", b"").unwrap();
    other.join().unwrap().unwrap();
}

#[test]
fn a_key_never_set_times_out_naming_the_key_and_the_rank() {
    let m = master();
    let st = client(m.port(), 3, Duration::from_millis(300));
    let e = st.get("never/set").unwrap_err();
    assert!(matches!(e, Error::Timeout { rank: 3, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("never/set") && msg.contains("rank 3"), "{msg}");
    let e = st.wait(&["a", "b"]).unwrap_err().to_string();
    assert!(
        e.contains("\"a\"") && e.contains("\"b\"") && e.contains("rank 3"),
        "{e}"
    );
    // The client is still usable after a timeout.
    st.set("a", b"1").unwrap();
    let e = st
        .wait_timeout(&["a", "b"], Duration::from_millis(50))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[\"b\"]"), "only the missing key is named: {e}");
    // A counter on a key that holds text is an error, not a panic.
    st.set("text", b"abc").unwrap();
    let e = st.add("text", 1).unwrap_err().to_string();
    assert!(e.contains("not an integer"), "{e}");
}

#[test]
fn a_client_retries_until_the_server_comes_up() {
    let port = free_port();
    let c = std::thread::spawn(move || TcpStore::new("127.0.0.1", port, 1, false, LONG));
    // The client is retrying (or not started yet): either way it must connect once the
    // server is up.
    std::thread::sleep(Duration::from_millis(100));
    let server = TcpStoreServer::bind("127.0.0.1", port).unwrap();
    let st = c.join().unwrap().unwrap();
    st.set("k", b"v").unwrap();
    assert_eq!(st.get("k").unwrap(), b"v");
    drop(server);
    // The server is gone: requests fail with an error.
    assert!(st.get("k").is_err());
}

#[test]
fn no_server_at_all_is_a_timeout_naming_the_address() {
    let port = free_port();
    let e = TcpStore::new("127.0.0.1", port, 2, false, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(e, Error::Timeout { rank: 2, .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    let e = TcpStore::new("no-such-host.invalid", 1, 0, false, LONG).unwrap_err();
    assert!(e.to_string().contains("does not resolve"), "{e}");
}

#[test]
fn bad_bytes_to_the_server_are_refused_and_others_are_still_served() {
    let m = master();
    let port = m.port();
    for garbage in [
        &[0xff, 0xff, 0xff, 0xff][..],        // a frame over the size limit
        &[3, 0, 0, 0, 9, 9, 9][..],           // not the greeting
        &[2, 0, 0, 0, 0][..],                 // truncated body, then EOF
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", // another protocol
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        s.write_all(garbage).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        // The server answers an error frame (or nothing) and closes the connection.
        let _ = s.read_to_end(&mut reply);
    }
    // A greeted client that then sends an unknown opcode is dropped too.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    let (accepted, why) = common::raw_handshake(&mut s, "store rank 1", "", b"").unwrap();
    assert!(accepted, "an open store accepts a client without id: {why}");
    let magic = b"fsdp-tcpstore/2";
    let mut hello = vec![(1 + 4 + magic.len()) as u8, 0, 0, 0, 0];
    hello.extend_from_slice(&(magic.len() as u32).to_le_bytes());
    hello.extend_from_slice(magic);
    s.write_all(&hello).unwrap();
    s.write_all(&[1, 0, 0, 0, 200]).unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("unknown opcode 200"),
        "{reply:?}"
    );
    m.set("still", b"works").unwrap();
    assert_eq!(client(port, 1, LONG).get("still").unwrap(), b"works");
}

#[test]
fn bad_bytes_from_a_fake_server_are_errors_for_the_client() {
    let fake = |reply: Vec<u8>| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf);
                let _ = s.write_all(&reply);
            }
        });
        port
    };
    for reply in [
        vec![0xff, 0xff, 0xff, 0x7f], // an absurd length
        vec![5, 0, 0, 0, 0, 1],       // a truncated frame, then EOF
        vec![1, 0, 0, 0, 42],         // an unknown status
        b"HTTP/1.1 400 Bad Request\r\n".to_vec(),
        vec![], // closed without a word
    ] {
        let port = fake(reply.clone());
        let e = TcpStore::new("127.0.0.1", port, 0, false, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(e, Error::Io { .. } | Error::Timeout { .. }),
            "{reply:?}: {e:?}"
        );
    }
}

#[test]
fn prefix_stores_keep_users_apart() {
    let m: Arc<dyn Store> = Arc::new(master());
    let a = PrefixStore::new("group/a", m.clone());
    let b = PrefixStore::new("group/b", m.clone());
    a.set("id", b"A").unwrap();
    b.set("id", b"B").unwrap();
    assert_eq!(a.get("id").unwrap(), b"A");
    assert_eq!(b.get("id").unwrap(), b"B");
    assert_eq!(m.get("group/a/id").unwrap(), b"A");
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert!(a.check(&["id", "n"]).unwrap() && !b.check(&["n"]).unwrap());
    a.wait(&["id"]).unwrap();
    assert!(b.delete_key("id").unwrap());
    assert_eq!(a.num_keys().unwrap(), 2, "num_keys counts the whole store");
}

/// A SET, a GET and a DELETE request, framed as a client after the handshake sends them.
fn raw_requests() -> Vec<u8> {
    let frame = |body: Vec<u8>| {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend(body);
        f
    };
    let field = |b: &[u8]| {
        let mut f = (b.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(b);
        f
    };
    let mut out = Vec::new();
    out.extend(frame([vec![1], field(b"k"), field(b"evil")].concat()));
    out.extend(frame(
        [vec![2], field(b"k"), 0u64.to_le_bytes().to_vec()].concat(),
    ));
    out.extend(frame([vec![6], field(b"k")].concat()));
    out
}

#[test]
fn a_secured_store_serves_only_clients_of_its_job_that_prove_the_secret() {
    let k1 = JobSecret::new("the first job secret, 32 chars..").unwrap();
    let k2 = JobSecret::new("another job secret, also long...").unwrap();
    let job = |id: &str, k: Option<&JobSecret>| JobAuth::new(id, k.cloned()).unwrap();
    let m = TcpStore::with_auth("127.0.0.1", 0, 0, true, LONG, job("job-a", Some(&k1))).unwrap();
    let port = m.port();
    m.set("k", b"the value").unwrap();
    let member =
        TcpStore::connect_with_auth("127.0.0.1", port, 1, LONG, job("job-a", Some(&k1))).unwrap();
    assert_eq!(member.get("k").unwrap(), b"the value");
    // Refused at connect, before any request: a wrong secret (twice), none, another job.
    let refused =
        |auth: JobAuth| match TcpStore::connect_with_auth("127.0.0.1", port, 7, LONG, auth) {
            Err(e @ Error::Refused { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        };
    for _ in 0..2 {
        let e = refused(job("job-a", Some(&k2)));
        assert!(
            e.starts_with(&format!("TCPStore at 127.0.0.1:{port} (rank 7): "))
                && e.contains("it could not prove this job's secret: the secrets differ"),
            "{e}"
        );
    }
    let e = refused(job("job-a", None));
    assert!(
        e.contains("it requires the job secret and this rank has none (FSDP_JOB_SECRET is not set"),
        "{e}"
    );
    let e = refused(job("job-b", Some(&k1)));
    assert!(
        e.contains("it belongs to job 'job-a', not to this rank's job 'job-b': another job holds this address"),
        "{e}"
    );
    // A client that skips the handshake, or fakes a proof, cannot set, get or delete.
    for fake in [None, Some([0u8; 32])] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        if let Some(proof) = fake {
            let (accepted, why) =
                common::raw_handshake(&mut s, "store rank 9", "job-a", &proof).unwrap();
            assert!(!accepted);
            assert_eq!(why, "its proof of the job secret is wrong (another secret)");
        }
        let _ = s.write_all(&raw_requests());
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        assert!(
            !String::from_utf8_lossy(&reply).contains("the value"),
            "{reply:?}"
        );
    }
    assert_eq!(member.get("k").unwrap(), b"the value");
    assert_eq!(m.num_keys().unwrap(), 1);
    // Each refused peer is logged once, naming it and why, never with the secret.
    let log = m.server().unwrap().refused();
    let count = |want: &str| log.iter().filter(|l| l.contains(want)).count();
    let head = format!("fsdp: TCPStore at 127.0.0.1:{port}: refused a connection from 127.0.0.1:");
    assert!(log.iter().all(|l| l.starts_with(&head)), "{log:?}");
    assert_eq!(
        count("(store rank 7, job 'job-a'): its proof of the job secret is wrong"),
        1,
        "{log:?}"
    );
    assert_eq!(
        count("(store rank 9, job 'job-a'): its proof of the job secret is wrong"),
        1
    );
    assert_eq!(
        count("(store rank 7, job 'job-a'): it has no job secret and this job requires one"),
        1
    );
    assert_eq!(
        count("(store rank 7, job 'job-b'): it is of job 'job-b', not of this job 'job-a'"),
        1
    );
    assert_eq!(count("it does not speak the fsdp handshake"), 1, "{log:?}");
    assert_eq!(log.len(), 5, "{log:?}");
    for l in &log {
        assert!(!l.contains(k1.expose()) && !l.contains(k2.expose()), "{l}");
    }
    // A client with a secret refuses a store without one: it is not its job's.
    let open = master();
    let e = TcpStore::connect_with_auth("127.0.0.1", open.port(), 1, LONG, job("", Some(&k1)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("it runs without a job secret but this rank has one"),
        "{e}"
    );
}

#[test]
fn a_store_host_that_is_not_this_machine_is_an_error_within_seconds() {
    // TEST-NET-3: never an address of this machine. The server is up (on every interface),
    // so there is nothing to wait for.
    let t = std::time::Instant::now();
    let e = TcpStore::new("203.0.113.1", 0, 0, true, Duration::from_secs(300)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.starts_with("TCPStore: rank 0 hosts the store on port ")
            && msg.contains(" but cannot reach it at 203.0.113.1:")
            && msg.contains("; 203.0.113.1 is not an address of this machine (MASTER_ADDR / --master-addr must name the machine where rank 0 runs)"),
        "{msg}"
    );
    // A port in use: the message says another job may hold it.
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let e = TcpStore::new("127.0.0.1", port, 0, true, LONG)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "TCPStore: port {port} on 127.0.0.1 is in use (another job holds it"
        )),
        "{e}"
    );
}

/// Threads of this process named `name` (`/proc/self/task/*/comm`).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
                .filter(|c| c.trim() == name)
                .count()
        })
        .unwrap_or(0)
}

#[cfg(target_os = "linux")]
#[test]
fn idle_connections_are_bounded_and_the_clients_work_on() {
    use fsdp::distributed::store::MAX_HANDSHAKES;
    let secret = JobSecret::new("a-secret-of-the-load-test").unwrap();
    let auth = JobAuth::new("load", Some(secret)).unwrap();
    let m = TcpStore::with_auth("127.0.0.1", 0, 0, true, LONG, auth.clone()).unwrap();
    let port = m.port();
    let early = TcpStore::connect_with_auth("127.0.0.1", port, 1, LONG, auth.clone()).unwrap();
    // 300 connections that never say a word (as a port scan or a flood would).
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let server = m.server().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.busy_refusals() < 300usize.saturating_sub(MAX_HANDSHAKES) as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            server.busy_refusals()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every connection was accepted by now; let the admitted ones' threads start.
    std::thread::sleep(Duration::from_millis(300));
    // At most MAX_HANDSHAKES (64) in the handshake, plus the two clients; other tests of
    // this binary run stores too, whose few serving threads fit the slack.
    let serving = threads_named("tcpstore-conn");
    assert!(
        serving < 100,
        "{serving} serving threads for 300 idle connections (bound {MAX_HANDSHAKES})"
    );
    // The clients already in work on, and a new one gets in (retrying BUSY answers).
    early.set("k", b"v").unwrap();
    assert_eq!(m.get("k").unwrap(), b"v");
    let late = TcpStore::connect_with_auth("127.0.0.1", port, 2, LONG, auth).unwrap();
    assert_eq!(late.add("n", 2).unwrap(), 2);
    assert_eq!(early.add("n", 3).unwrap(), 5);
    drop(idle);
}
