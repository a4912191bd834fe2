//! A peer process for the tests between processes: this test binary run again (with an
//! environment variable that makes it the peer), which announces its agent's and one
//! region's metadata on stdout (a hex line each, [`announce`]), then answers lines on its
//! stdin, one line each ([`Child::ask`]).

use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use xfer::{Access, Agent, AgentInfo, HostBuffer, MemoryRegion, RegionDescriptor};

/// Prints an agent's and a region's metadata (hex), one line each, for the parent.
pub fn announce(info: &AgentInfo, desc: &RegionDescriptor) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", hex::encode(info.to_bytes().unwrap())).unwrap();
    writeln!(out, "{}", hex::encode(desc.to_bytes().unwrap())).unwrap();
    out.flush().unwrap();
}

/// Answers each line of stdin with `answer(line)` on stdout until stdin closes.
pub fn serve(mut answer: impl FnMut(&str) -> String) {
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        writeln!(out, "{}", answer(&line)).unwrap();
        out.flush().unwrap();
    }
}

/// The usual peer: registers `len` bytes of host memory on `agent` for peers to write,
/// announces the agent and the region, then answers each line `check N` with `ok` when
/// `holds(region, N)`, `bad` otherwise, until stdin closes ([`Child::holds`] asks).
pub fn serve_region(agent: &Agent, len: usize, holds: impl Fn(&HostBuffer, u8) -> bool) {
    let mem = HostBuffer::new_shared(len).expect("memory");
    let r = agent
        .register(mem.clone(), Access::REMOTE_WRITE)
        .expect("a region");
    announce(agent.info(), r.descriptor());
    serve(|line| {
        let round: u8 = line.trim_start_matches("check ").parse().expect("check N");
        if holds(&mem, round) { "ok" } else { "bad" }.into()
    });
}

/// Round `round`'s bytes, for [`HostBuffer::fill_with`]: the offset modulo 251 xored with
/// the round, so that rounds and places differ.
pub fn pattern(round: u8) -> impl Fn(u64, &mut [u8]) {
    move |at, chunk| {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = ((at + i as u64) % 251) as u8 ^ round;
        }
    }
}

/// Whether `mem` holds round `round`'s [`pattern`] everywhere.
pub fn holds_pattern(mem: &HostBuffer, round: u8) -> bool {
    let want = HostBuffer::new(mem.len()).unwrap();
    want.fill_with(pattern(round));
    mem.to_vec(0, mem.len()).unwrap() == want.to_vec(0, mem.len()).unwrap()
}

/// The peer process; killed (after a SIGCONT, should it be stopped) when dropped.
pub struct Child {
    child: std::process::Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Child {
    /// Starts `cmd` (this binary, or `ip netns exec ... ` it, with the peer's environment)
    /// and reads what it announces.
    pub fn spawn(mut cmd: Command) -> (Child, AgentInfo, RegionDescriptor) {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the peer process");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = || {
            let mut l = String::new();
            stdout.read_line(&mut l).expect("the peer's metadata");
            hex::decode(l.trim()).expect("the peer's metadata, in hex")
        };
        let info = AgentInfo::from_bytes(&line()).unwrap();
        let desc = RegionDescriptor::from_bytes(&line()).unwrap();
        let c = Child {
            child,
            stdin,
            stdout,
        };
        (c, info, desc)
    }

    /// This test binary with `env=value` set: the peer.
    pub fn this_binary(env: &str, value: &str) -> Command {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env(env, value);
        cmd
    }

    /// Sends `line` and returns the answer's line, trimmed.
    pub fn ask(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        let mut l = String::new();
        self.stdout.read_line(&mut l).unwrap();
        l.trim().to_string()
    }

    /// Whether the peer's region holds round `round`'s bytes (its answer to `check N`, see
    /// [`serve_region`]).
    pub fn holds(&mut self, round: u8) -> bool {
        self.ask(&format!("check {round}")) == "ok"
    }

    /// Sends the process signal `sig`.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill has no memory preconditions; the pid is our own child's, not reaped.
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(r, 0, "kill({sig}): {}", std::io::Error::last_os_error());
    }

    /// Kills the process and waits for it to be gone (its ports free again).
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: as in `signal`; a continued process is killed at once below.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
