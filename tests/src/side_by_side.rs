//! Running one test case on two arms at once (two frameworks, two binaries).

/// Runs `case` for both `arms` side by side, each on a thread and a two-worker tokio runtime
/// of its own (as two tests would run: a case may block its runtime's workers now and then,
/// starting a server or running a client, and must never hold up the other's timed steps),
/// and fails naming the arm when either does; both run to their end first. A case mostly waits
/// (on leases, timeouts, slow handlers, servers), so the two overlap instead of queueing.
///
/// # Panics
/// When either arm's case panicked, with both arms' messages.
pub fn side_by_side<A, F>(arms: [(&str, A); 2], case: fn(A) -> F)
where
    A: Send + 'static,
    F: std::future::Future<Output = ()> + 'static,
{
    let threads = arms.map(|(name, arm)| {
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("a runtime")
                .block_on(case(arm));
        });
        (name, thread)
    });
    let mut failed = Vec::new();
    for (name, thread) in threads {
        if let Err(panic) = thread.join() {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "(a panic that is not a message)".to_owned());
            failed.push(format!("on {name}: {message}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
