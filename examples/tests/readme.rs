//! README.md as a newcomer follows it: every ```sh block, top to bottom, run as written by
//! `bash` against the demo this test starts, and every output the README states checked.
//!
//! - A command's stated output is the `#` lines right below it (no blank line between); `…`
//!   stands for anything. Each such line must be a line the command printed (stdout or
//!   stderr, in any order, as header order is no promise). A `curl -i` must state its output.
//! - A command must exit 0, unless its stated output is a curl error (`curl: (28) …`).
//! - `cargo run -p idempotent-examples --bin charges-axum [-- FLAGS]` (re)starts the demo, as a
//!   reader does in another terminal: this build's binary with those flags, listening on a
//!   free port (`--listen 127.0.0.1:0`) in a directory of its own, without `DATABASE_URL`.
//!   `localhost:3000` and `127.0.0.1:3000` in commands become that port. The demo is stopped
//!   as a reader stops it (SIGINT) and must exit cleanly.
//! - Other `cargo run -p …` commands run this build's binaries (a stand-in `cargo` on `PATH`),
//!   and `idempotent-admin` the workspace's build of it.
//! - Everything is run twice: as written (Axum), and with `charges-actix` for `charges-axum`,
//!   since the README promises the same flags, routes and answers.
//! - Skipped, with the reason printed: `cargo test` (the suite this test is part of, a fuzz
//!   campaign), `cargo install`, `cargo semver-checks`; the RabbitMQ pair without
//!   `DATABASE_URL` or a broker at 127.0.0.1:5672 (with them its queue gets a name of its own
//!   and its PostgreSQL URL is `DATABASE_URL`).
//!
//! Besides the blocks: the flags the README names exist in both binaries' `--help`, and the
//! files the demo leaves in its directory are all ignored by `.gitignore`.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

const README: &str = include_str!("../../README.md");
const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The longest a demo may take to start or stop, and a run of commands to finish.
const BOUND: Duration = Duration::from_secs(60);

/// Says something in the test's output whether or not the test passes (libtest captures only
/// the print macros).
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "readme: {line}");
}

/// One command of a block, as written (continuation lines kept), and its stated output.
#[derive(Debug)]
struct Cmd {
    /// 1-based line in README.md.
    line: usize,
    text: String,
    output: Vec<String>,
}

impl Cmd {
    /// The command on one line, without a trailing comment.
    fn bare(&self) -> String {
        let joined = self.text.replace("\\\n", " ");
        let cut = match joined.find(" #") {
            Some(at) if !joined[..at].contains(['\'', '"']) => &joined[..at],
            _ => &joined[..],
        };
        cut.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

#[derive(Debug)]
struct Block {
    line: usize,
    cmds: Vec<Cmd>,
}

/// The ```sh blocks of `text`.
fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_end() != "```sh" {
            i += 1;
            continue;
        }
        let mut block = Block {
            line: i + 1,
            cmds: Vec::new(),
        };
        i += 1;
        let mut after_cmd = false;
        while i < lines.len() && lines[i].trim_end() != "```" {
            let line = lines[i];
            if line.trim().is_empty() {
                after_cmd = false;
            } else if let Some(comment) = line.strip_prefix('#') {
                if after_cmd {
                    let said = comment.strip_prefix(' ').unwrap_or(comment);
                    if !said.trim().is_empty() {
                        block.cmds.last_mut().unwrap().output.push(said.to_owned());
                    }
                }
            } else {
                let start = i;
                let mut text = line.to_owned();
                while text.ends_with('\\') && i + 1 < lines.len() {
                    i += 1;
                    text.push('\n');
                    text.push_str(lines[i]);
                }
                block.cmds.push(Cmd {
                    line: start + 1,
                    text,
                    output: Vec::new(),
                });
                after_cmd = true;
            }
            i += 1;
        }
        out.push(block);
        i += 1;
    }
    out
}

/// Whether `line` is `pattern`, `…` in it standing for any text.
fn glob(pattern: &str, line: &str) -> bool {
    let parts: Vec<&str> = pattern.split('…').collect();
    if parts.len() == 1 {
        return pattern == line;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !line.starts_with(first) || line.len() < first.len() + last.len() || !line.ends_with(last) {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fw {
    Axum,
    Actix,
}

impl Fw {
    fn bin(self) -> &'static str {
        match self {
            Fw::Axum => "charges-axum",
            Fw::Actix => "charges-actix",
        }
    }
}

/// What the test does with a command.
#[derive(Debug)]
enum Kind {
    /// (Re)start the demo with these flags.
    Demo(Vec<String>),
    /// Not run here, and why.
    Skip(&'static str),
    /// Run by bash.
    Run,
}

fn kind(cmd: &Cmd) -> Kind {
    let bare = cmd.bare();
    let words: Vec<&str> = bare
        .split(' ')
        .skip_while(|w| w.contains('=') && !w.starts_with('-'))
        .collect();
    if words.first() != Some(&"cargo") {
        return Kind::Run;
    }
    let demo = ["run", "-p", "idempotent-examples", "--bin", "charges-axum"];
    if words.len() >= 6 && words[1..6] == demo {
        let flags = match words.get(6) {
            None => Vec::new(),
            Some(&"--") => words[7..].iter().map(|w| (*w).to_owned()).collect(),
            Some(other) => panic!(
                "README:{}: `{other}` after the demo's name goes to cargo, not the demo: put it after `--`",
                cmd.line
            ),
        };
        assert!(
            !bare.contains(['\'', '"']),
            "README:{}: quoted demo flags",
            cmd.line
        );
        return Kind::Demo(flags);
    }
    match words.get(1).copied() {
        Some("run") => Kind::Run,
        Some("test") if bare.contains("FUZZ_SECONDS") => {
            Kind::Skip("a fuzz campaign, as long as FUZZ_SECONDS says")
        }
        Some("test") => Kind::Skip("a test run of its own (this test is part of the suite)"),
        Some("install") if bare.contains("--path") => Kind::Skip(
            "installs a release build into ~/.cargo/bin; the commands after it run this build's",
        ),
        Some("install") => Kind::Skip("installs a tool from crates.io"),
        Some("semver-checks") => {
            Kind::Skip("compares with the last published release, from crates.io")
        }
        _ => panic!(
            "README:{}: the README test does not know `{bare}`: run it or skip it with a reason",
            cmd.line
        ),
    }
}

/// Why a block cannot run here, if it cannot.
fn cannot_run(block: &Block, fw: Fw, admin: &Path) -> Option<String> {
    let all: Vec<String> = block.cmds.iter().map(Cmd::bare).collect();
    let any = |s: &str| all.iter().any(|c| c.contains(s));
    let web = any("charges-axum") || any(":3000") || any("charges.db");
    if fw == Fw::Actix && !web {
        return Some("no web framework in it (run once, with Axum)".into());
    }
    if any("postgres://") && std::env::var("DATABASE_URL").is_err() {
        return Some("needs PostgreSQL: DATABASE_URL is not set".into());
    }
    if (any("orders-producer") || any("payments-consumer"))
        && std::net::TcpStream::connect_timeout(
            &"127.0.0.1:5672".parse().unwrap(),
            Duration::from_secs(1),
        )
        .is_err()
    {
        return Some("needs RabbitMQ at 127.0.0.1:5672".into());
    }
    if any("idempotent-admin --") && !admin.exists() {
        return Some(format!(
            "idempotent-admin is not built ({}): `cargo build -p idempotent-admin` (cargo test --workspace builds it)",
            admin.display()
        ));
    }
    None
}

/// The demo, running; stopped with SIGINT by [`Demo::stop`], killed on drop.
struct Demo {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Demo {
    fn start(bin: &Path, flags: &[String], dir: &Path, log: PathBuf) -> Demo {
        let mut child = Command::new(bin)
            .args(flags)
            .args(["--listen", "127.0.0.1:0"])
            .current_dir(dir)
            .env_remove("DATABASE_URL")
            .env_remove("IDEMPOTENCY_SECRET")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (send, recv) = channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = send.send(first);
            }
            // Keep reading, so the demo never blocks on a full pipe.
            for _ in lines {}
        });
        let first = recv.recv_timeout(BOUND).unwrap_or_else(|_| {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{} {flags:?} printed no first line; its log:\n{}",
                bin.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        // The README: "The demo prints `listening on http://127.0.0.1:3000`".
        let port = first
            .strip_prefix("listening on http://127.0.0.1:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("first line: {first:?}"));
        Demo { child, port, log }
    }

    /// Ctrl-C, as a reader stops it: it must exit cleanly.
    fn stop(mut self) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
        assert!(sent.success());
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "the demo exited {status} on SIGINT; its log:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
                return;
            }
            assert!(Instant::now() < deadline, "the demo did not stop on SIGINT");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One pass over the README: its directory, the demo, what it ran and skipped.
struct Pass<'a> {
    fw: Fw,
    dir: PathBuf,
    logs: PathBuf,
    path: String,
    bins: &'a Path,
    demo: Option<Demo>,
    /// RabbitMQ queue names given to the pair (deleted at the end).
    queue: String,
    ran: usize,
    skipped: usize,
}

impl Pass<'_> {
    /// A command as it runs here: the demo's port, the test's PostgreSQL and queue.
    fn rewrite(&self, cmd: &Cmd) -> String {
        let mut text = cmd.text.clone();
        if text.contains(":3000") {
            let port = self.demo.as_ref().map_or_else(
                || panic!("README:{}: no demo is running for it", cmd.line),
                |d| d.port,
            );
            for host in ["localhost", "127.0.0.1"] {
                text = text.replace(&format!("{host}:3000"), &format!("{host}:{port}"));
            }
        }
        if let Ok(url) = std::env::var("DATABASE_URL") {
            text = text.replace("postgres://postgres@127.0.0.1:5432/test", &url);
        }
        text.replace("--queue payments", &format!("--queue {}", self.queue))
    }

    fn block(&mut self, block: &Block, admin: &Path) {
        if let Some(why) = cannot_run(block, self.fw, admin) {
            say(&format!(
                "{:?}: README:{} skipped: {why}",
                self.fw, block.line
            ));
            self.skipped += block.cmds.len();
            return;
        }
        let mut batch: Vec<&Cmd> = Vec::new();
        for cmd in &block.cmds {
            match kind(cmd) {
                Kind::Run => batch.push(cmd),
                Kind::Skip(why) => {
                    say(&format!(
                        "{:?}: README:{} `{}` skipped: {why}",
                        self.fw,
                        cmd.line,
                        cmd.bare()
                    ));
                    self.skipped += 1;
                }
                Kind::Demo(flags) => {
                    self.run(&std::mem::take(&mut batch));
                    self.restart(cmd, &flags);
                }
            }
        }
        self.run(&batch);
    }

    fn restart(&mut self, cmd: &Cmd, flags: &[String]) {
        if let Some(old) = self.demo.take() {
            old.stop();
        }
        let bin = self.bins.join(self.fw.bin());
        let log = self.logs.join(format!("demo-{}.log", cmd.line));
        println!("README:{}: {} {flags:?}", cmd.line, self.fw.bin());
        self.demo = Some(Demo::start(&bin, flags, &self.dir, log));
        if !flags.iter().any(|f| f == "--database") {
            // "the demo: a charges API on SQLite (charges.db)"
            assert!(self.dir.join("charges.db").exists(), "no charges.db");
        }
        self.ran += 1;
    }

    /// Runs `cmds` in one bash, as typed, each followed by a marker line on stdout and stderr
    /// (with its exit status), then checks each one's status and stated output.
    fn run(&mut self, cmds: &[&Cmd]) {
        if cmds.is_empty() {
            return;
        }
        let mut script = String::new();
        for (i, cmd) in cmds.iter().enumerate() {
            script.push_str(&self.rewrite(cmd));
            script.push_str(&format!(
                "\n__rc=$?; printf '\\n\\036%d %d\\n' {i} $__rc; printf '\\n\\036%d\\n' {i} >&2\n"
            ));
        }
        println!("{script}");
        let mut child = Command::new("bash")
            .args(["-c", &script])
            .current_dir(&self.dir)
            .env("PATH", &self.path)
            .env_remove("DATABASE_URL")
            .env_remove("IDEMPOTENCY_SECRET")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so what it leaves in the background can be stopped.
            .process_group(0)
            .spawn()
            .unwrap();
        let read = |mut from: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = from.read_to_string(&mut text);
                text
            })
        };
        let out = read(Box::new(child.stdout.take().unwrap()));
        let err = read(Box::new(child.stderr.take().unwrap()));
        let deadline = Instant::now() + BOUND;
        while child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "README:{}: still running after {BOUND:?}",
                cmds[0].line
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // A command left in the background (`&`) has a little longer to finish.
        let grace = Instant::now() + Duration::from_secs(10);
        while !(out.is_finished() && err.is_finished()) && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(20));
        }
        let group = format!("-{}", child.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let (out, err) = (out.join().unwrap(), err.join().unwrap());
        let outs = sections(&out, cmds.len());
        let errs = sections(&err, cmds.len());
        for (i, cmd) in cmds.iter().enumerate() {
            let (printed, status) = &outs[i];
            let printed: Vec<&str> = printed
                .iter()
                .chain(&errs[i].0)
                .flat_map(|l| l.split('\r'))
                .filter(|l| !l.is_empty())
                .collect();
            let context = || {
                format!(
                    "README:{} ({:?}):\n{}\nprinted:\n{}",
                    cmd.line,
                    self.fw,
                    cmd.text,
                    printed.join("\n")
                )
            };
            let status = status.unwrap_or_else(|| panic!("did not finish: {}", context()));
            let curl_error = cmd.output.iter().any(|l| l.starts_with("curl: ("));
            assert!(
                status == 0 || curl_error,
                "exit status {status}: {}",
                context()
            );
            if cmd.bare().contains("curl -i") {
                assert!(
                    !cmd.output.is_empty(),
                    "README:{}: a `curl -i` whose output the README does not state",
                    cmd.line
                );
            }
            for said in &cmd.output {
                assert!(
                    printed.iter().any(|l| glob(said, l)),
                    "the README says `{said}`, which is not printed: {}",
                    context()
                );
            }
            self.ran += 1;
        }
    }
}

/// The output of each of `n` commands, split at the markers, and its exit status if the
/// marker had one.
fn sections(text: &str, n: usize) -> Vec<(Vec<String>, Option<i32>)> {
    let mut out = vec![(Vec::new(), None); n];
    let mut at = 0;
    for line in text.split('\n') {
        if let Some(marker) = line.strip_prefix('\u{1e}') {
            let mut words = marker.split(' ');
            let i: usize = words.next().unwrap().parse().unwrap();
            out[i].1 = Some(words.next().map_or(0, |s| s.parse().unwrap()));
            at = i + 1;
        } else if at < n && !line.is_empty() {
            out[at].0.push(line.to_owned());
        }
    }
    out
}

/// Writes the stand-ins: `cargo run -p …` runs this build's binary, `idempotent-admin` the
/// workspace's.
fn shims(dir: &Path, bins: &Path) {
    let cargo = format!(
        r#"#!/bin/sh
# The README test's stand-in for cargo: `cargo run -p PACKAGE [--bin NAME] [-- ARGS]` runs
# the binary this build made.
if [ "$1" = run ] && [ "$2" = -p ]; then
  case "$3" in
    idempotent-examples) [ "$4" = --bin ] || exit 97; bin="$5"; shift 5 ;;
    idempotent-admin) bin=idempotent-admin; shift 3 ;;
    *) echo "readme test: no stand-in for cargo $*" >&2; exit 97 ;;
  esac
  [ "$1" = -- ] && shift
  exec "{bins}/$bin" "$@"
fi
echo "readme test: no stand-in for cargo $*" >&2
exit 97
"#,
        bins = bins.display()
    );
    let admin = format!(
        "#!/bin/sh\nexec \"{}/idempotent-admin\" \"$@\"\n",
        bins.display()
    );
    for (name, text) in [("cargo", cargo), ("idempotent-admin", admin)] {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&path, perms).unwrap();
    }
}

/// The flags the README names for the demo (the paragraph after "The demo prints"), each in
/// both binaries' `--help`.
fn flags_exist(bins: &Path) {
    let start = README
        .find("The demo prints")
        .expect("the demo's paragraph");
    let paragraph = &README[start..];
    let paragraph = &paragraph[..paragraph.find("\n\n").unwrap_or(paragraph.len())];
    let named: Vec<&str> = paragraph
        .split("`--")
        .skip(1)
        .map(|rest| {
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '-'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| !name.is_empty())
        .collect();
    assert!(named.len() >= 9, "flags named: {named:?}");
    for fw in [Fw::Axum, Fw::Actix] {
        let help = Command::new(bins.join(fw.bin()))
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        assert!(help.contains("[default: 127.0.0.1:3000]"), "{help}");
        for name in &named {
            assert!(
                help.contains(&format!("--{name} ")),
                "README names `--{name}`, not in {} --help:\n{help}",
                fw.bin()
            );
        }
    }
}

/// Every file the demo left in `dir` is ignored by the repository's `.gitignore`.
fn ignored(dir: &Path) {
    let names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n == "charges.db.provider"),
        "{names:?}"
    );
    let Ok(check) = Command::new("git")
        .args(["check-ignore", "--no-index", "--verbose", "--non-matching"])
        .args(&names)
        .current_dir(REPO)
        .output()
    else {
        say("git is not here: .gitignore not checked");
        return;
    };
    let report = String::from_utf8_lossy(&check.stdout);
    let unignored: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("::\t"))
        .collect();
    assert!(
        unignored.is_empty() && report.lines().count() == names.len(),
        ".gitignore misses what the demo writes: {unignored:?}\n{report}"
    );
}

/// Deletes the queue the RabbitMQ pair used, if it made one.
fn delete_queue(queue: &str) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let amqp = "amqp://guest:guest@127.0.0.1:5672/%2f";
        let Ok((conn, channel)) = idempotent_examples::outbox::channel(amqp, queue).await else {
            return;
        };
        let _ = channel
            .queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default())
            .await;
        let _ = conn.close(200, "done".into()).await;
    });
}

#[test]
fn readme_commands_work() {
    let started = Instant::now();
    let bins = Path::new(env!("CARGO_BIN_EXE_charges-axum"))
        .parent()
        .unwrap()
        .to_owned();
    let admin = bins.join("idempotent-admin");
    let blocks = blocks(README);
    assert!(blocks.len() >= 8, "sh blocks: {}", blocks.len());
    flags_exist(&bins);

    let tmp = tempfile::tempdir().unwrap();
    let shim = tmp.path().join("bin");
    std::fs::create_dir(&shim).unwrap();
    shims(&shim, &bins);
    let path = format!(
        "{}:{}",
        shim.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for fw in [Fw::Axum, Fw::Actix] {
        let dir = tmp.path().join(format!("{fw:?}"));
        let logs = tmp.path().join(format!("{fw:?}-logs"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::create_dir(&logs).unwrap();
        let mut pass = Pass {
            fw,
            dir,
            logs,
            path: path.clone(),
            bins: &bins,
            demo: None,
            queue: format!("payments_readme_{}", uuid::Uuid::new_v4().simple()),
            ran: 0,
            skipped: 0,
        };
        for block in &blocks {
            pass.block(block, &admin);
        }
        if let Some(demo) = pass.demo.take() {
            demo.stop();
        }
        delete_queue(&pass.queue);
        ignored(&pass.dir);
        say(&format!(
            "{fw:?}: {} commands run, {} skipped ({:.1} s so far)",
            pass.ran,
            pass.skipped,
            started.elapsed().as_secs_f64()
        ));
    }
}

#[test]
fn stated_output_is_parsed() {
    let text = "x\n```sh\n# about a\na \\\n  b\n# said 1\n# said 2\n\n# about c\nc # note\n```\n";
    let got = blocks(text);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].cmds.len(), 2);
    assert_eq!(got[0].cmds[0].text, "a \\\n  b");
    assert_eq!(got[0].cmds[0].output, ["said 1", "said 2"]);
    assert_eq!(got[0].cmds[1].bare(), "c");
    assert!(got[0].cmds[1].output.is_empty());
    assert!(glob("a…c…e", "abcde"));
    assert!(glob("HTTP/1.1 201 Created", "HTTP/1.1 201 Created"));
    assert!(!glob("a…c", "ab"));
    assert!(!glob("retry-after: …", "content-type: x"));
}
