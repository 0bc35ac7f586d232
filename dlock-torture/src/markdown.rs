//! `--markdown PATH`: the results part of RELIABILITY.md, written by the run
//! that measured it. Hand-copied figures went stale and contradicted each
//! other; a block the harness writes carries its own stamp (commit, date,
//! command, seed, build, cores, wall time) and every row's figures, verdict
//! and notes, and is replaced whole on the next run.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::harness::Report;

/// The line the generated block starts with (followed by the stamp's command).
pub(crate) const BEGIN: &str = "<!-- BEGIN GENERATED: dlock-torture --markdown";
/// The line it ends with.
pub(crate) const END: &str = "<!-- END GENERATED -->";

/// Where and how a run was made.
#[derive(Debug, Clone)]
pub(crate) struct Stamp {
    /// `git rev-parse --short HEAD`, `+dirty` when tracked files differ, or
    /// `unknown` without git.
    pub(crate) commit: String,
    pub(crate) started_unix_s: u64,
    pub(crate) command: String,
    pub(crate) seed: u64,
    pub(crate) profile: &'static str,
    pub(crate) cores: usize,
    pub(crate) wall: Duration,
}

impl Stamp {
    /// The stamp of this process's run, begun at `started` on `commit`
    /// (read at the start: the run itself writes tracked files, the
    /// timelines and this block) with `args`.
    pub(crate) fn of_this_run(commit: String, args: &[String], seed: u64, started: SystemTime, wall: Duration) -> Self {
        Stamp {
            commit,
            started_unix_s: started.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            command: command_line(args),
            seed,
            profile: if cfg!(debug_assertions) { "debug" } else { "release" },
            cores: std::thread::available_parallelism().map_or(0, usize::from),
            wall,
        }
    }
}

/// The checkout's commit; `unknown` when git or the repository is missing,
/// since a run must not fail for its stamp.
pub(crate) fn commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(head) if !head.is_empty() => {
            // Untracked files (a history kept with DLOCK_TORTURE_KEEP, the
            // timelines being written) do not change what was built.
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}+dirty")
            } else {
                head
            }
        }
        _ => "unknown".to_owned(),
    }
}

/// The command as a shell would take it back.
fn command_line(args: &[String]) -> String {
    let quote = |a: &String| {
        if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:+,".contains(c)) {
            a.clone()
        } else {
            format!("'{}'", a.replace('\'', r"'\''"))
        }
    };
    let mut words = vec!["dlock-torture".to_owned()];
    words.extend(args.iter().map(quote));
    words.join(" ")
}

/// `YYYY-MM-DD HH:MM UTC` from Unix seconds (the civil-from-days
/// algorithm; no date crate for one line).
fn utc(unix_s: u64) -> String {
    let days = i64::try_from(unix_s / 86_400).unwrap_or(0);
    let secs = unix_s % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02} UTC", secs / 3600, secs % 3600 / 60)
}

/// A row's verdict, as the text table prints it.
pub(crate) fn verdict(r: &Report) -> &'static str {
    match (r.pass && r.safety_ok(), r.caught) {
        (true, Some(true)) => "caught",
        (true, _) => "ok",
        (false, _) => "FAIL",
    }
}

/// `scenario n` for each scenario, in run order: how many rows (arms,
/// backends, variants) it reported, so that no count has to be typed in
/// the prose.
fn rows_per_scenario(rows: &[Report]) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for r in rows {
        match counts.iter_mut().find(|(name, _)| *name == r.scenario) {
            Some((_, n)) => *n += 1,
            None => counts.push((&r.scenario, 1)),
        }
    }
    counts.iter().map(|(name, n)| format!("{name} {n}")).collect::<Vec<_>>().join(", ")
}

/// Text for a table cell: a `|` would end the cell, a line break the row.
fn cell(s: &str) -> String {
    s.replace('|', r"\|").replace('\n', " ")
}

/// The generated block, markers included.
pub(crate) fn block(stamp: &Stamp, rows: &[Report]) -> String {
    let mut s = String::new();
    let failed = rows.iter().filter(|r| verdict(r) == "FAIL").count();
    let _ = writeln!(s, "{BEGIN} (regenerate with the command below; do not edit by hand) -->");
    let _ = writeln!(s);
    let _ = writeln!(s, "| run | |");
    let _ = writeln!(s, "|---|---|");
    let _ = writeln!(s, "| commit | `{}` |", cell(&stamp.commit));
    let _ = writeln!(s, "| date | {} |", utc(stamp.started_unix_s));
    let _ = writeln!(s, "| command | `{}` |", cell(&stamp.command));
    let _ = writeln!(s, "| seed | {} |", stamp.seed);
    let _ = writeln!(s, "| build | {} |", stamp.profile);
    let _ = writeln!(s, "| cores | {} |", stamp.cores);
    let _ = writeln!(s, "| wall time | {:.0} s |", stamp.wall.as_secs_f64());
    let _ = writeln!(s, "| rows | {} ({failed} FAIL) |", rows.len());
    let _ = writeln!(s, "| rows per scenario | {} |", cell(&rows_per_scenario(rows)));
    let variants: Vec<&str> = rows
        .iter()
        .filter(|r| r.scenario == "checker-self-test" && r.backend.starts_with("broken-"))
        .map(|r| r.backend.as_str())
        .collect();
    let _ = writeln!(s, "| broken variants | {}: {} |", variants.len(), cell(&variants.join(", ")));
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| scenario | backend | safe | ops | faults | overlaps | lost | refused | st.acc | tok.reg | set.miss | \
         unf.lost | p50 ms | p99 ms | verdict | timeline |"
    );
    let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|");
    for r in rows {
        let overlaps = if r.overlaps_informational { format!("{} (i)", r.overlaps) } else { r.overlaps.to_string() };
        let tokens =
            if r.tokens_promised { r.token_regressions.to_string() } else { format!("{} (np)", r.token_regressions) };
        let v = verdict(r);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {} |",
            cell(&r.scenario),
            cell(&r.backend),
            if r.expected_safe { "yes" } else { "no" },
            r.operations,
            r.faults,
            overlaps,
            r.lost_updates,
            r.stale_writes_refused,
            r.stale_accepted,
            tokens,
            r.set_missing,
            r.unfenced_lost,
            r.p50_wait_ms,
            r.p99_wait_ms,
            if v == "FAIL" { "**FAIL**" } else { v },
            r.timeline.as_deref().map_or_else(|| "-".to_owned(), |p| format!("[svg]({})", p.replace(' ', "%20")))
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "Notes printed by the same run:");
    let _ = writeln!(s);
    for r in rows {
        if !r.notes.is_empty() {
            let _ =
                writeln!(s, "- **{} [{}]** ({}): {}", r.scenario, r.backend, verdict(r), r.notes.replace('\n', " "));
        }
    }
    let _ = writeln!(s);
    let _ = write!(s, "{END}");
    s
}

/// `doc` with its generated block replaced by `block`: exactly one pair of
/// markers must be there, so a second run replaces the first run's block
/// instead of adding another beside it.
pub(crate) fn replace_block(doc: &str, block: &str) -> Result<String, String> {
    let begins = doc.matches(BEGIN).count();
    if begins != 1 {
        return Err(format!("expected one `{BEGIN}` marker, found {begins}"));
    }
    let start = doc.find(BEGIN).ok_or("no begin marker")?;
    let end_at = doc[start..].find(END).ok_or_else(|| format!("no `{END}` after the begin marker"))? + start;
    let mut out = String::with_capacity(doc.len() + block.len());
    out.push_str(&doc[..start]);
    out.push_str(block);
    out.push_str(&doc[end_at + END.len()..]);
    Ok(out)
}

/// Writes the block: to stdout for `-`, into `path`'s markers when it
/// exists, else as a new file holding only the block.
pub(crate) fn write(path: &str, block: &str) -> Result<(), String> {
    if path == "-" {
        println!("{block}");
        return Ok(());
    }
    let text = match std::fs::read_to_string(path) {
        Ok(doc) => replace_block(&doc, block).map_err(|e| format!("{path}: {e}"))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!("{block}\n"),
        Err(e) => return Err(format!("cannot read {path}: {e}")),
    };
    std::fs::write(path, text).map_err(|e| format!("cannot write {path}: {e}"))
}

/// Checks before a run that `path` can take the block, so a long run does
/// not end unable to write its results.
pub(crate) fn check_target(path: &str) -> Result<(), String> {
    if path == "-" {
        return Ok(());
    }
    match std::fs::read_to_string(path) {
        Ok(doc) => replace_block(&doc, "").map(|_| ()).map_err(|e| format!("{path}: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot read {path}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp() -> Stamp {
        Stamp {
            commit: "abc1234".into(),
            started_unix_s: 1_795_000_000,
            command: command_line(&["--short".into(), "--markdown".into(), "RELIABILITY.md".into()]),
            seed: 7,
            profile: "debug",
            cores: 2,
            wall: Duration::from_secs(200),
        }
    }

    fn rows() -> Vec<Report> {
        let mut ok = Report::new("pause", "redis", 7);
        ok.expected_safe = true;
        ok.operations = 10;
        ok.note("T3: fine");
        ok.timeline = Some("docs/timelines/pause-redis.svg".into());
        let mut bad = Report::new("partition", "redis", 7);
        bad.expected_safe = true;
        bad.operations = 5;
        bad.lost_updates = 1;
        bad.fail("safety violated under a fault the backend promises to survive");
        vec![ok, bad]
    }

    /// A second run replaces the first run's block: one block, the new
    /// figures, the prose on both sides kept.
    #[test]
    fn the_block_is_replaced_not_duplicated() {
        let doc = format!("# prose before\n\n{BEGIN} -->\nold figures 12345\n{END}\n\nprose after\n");
        let first = replace_block(&doc, &block(&stamp(), &rows())).expect("replace");
        let second = replace_block(&first, &block(&stamp(), &rows()[..1])).expect("replace again");
        assert_eq!(second.matches(BEGIN).count(), 1, "{second}");
        assert_eq!(second.matches(END).count(), 1, "{second}");
        assert!(!second.contains("old figures") && !second.contains("| partition |"), "{second}");
        assert!(second.starts_with("# prose before\n") && second.ends_with("\n\nprose after\n"), "{second}");
        assert!(replace_block("no markers", "x").is_err());
        assert!(replace_block(&format!("{BEGIN}\n{END}\n{BEGIN}\n{END}"), "x").is_err());
    }

    /// A failing row says FAIL in the table and in its notes, and the stamp
    /// counts it.
    #[test]
    fn a_failing_row_shows_fail() {
        let b = block(&stamp(), &rows());
        let row = b.lines().find(|l| l.starts_with("| partition |")).expect("partition row");
        assert!(row.ends_with("| **FAIL** | - |"), "{row}");
        let ok_row = b.lines().find(|l| l.starts_with("| pause |")).expect("pause row");
        assert!(ok_row.ends_with("| ok | [svg](docs/timelines/pause-redis.svg) |"), "{ok_row}");
        assert!(b.contains("| rows | 2 (1 FAIL) |"), "{b}");
        assert!(b.contains("| rows per scenario | pause 1, partition 1 |"), "{b}");
        assert!(b.contains("| broken variants | 0:  |"), "{b}");
        assert!(b.contains("**partition [redis]** (FAIL): FAIL: safety violated"), "{b}");
        assert!(b.contains("| command | `dlock-torture --short --markdown RELIABILITY.md` |"), "{b}");
    }

    #[test]
    fn dates_and_commands_are_written_as_a_person_reads_them() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(1_795_000_000), "2026-11-18 11:06 UTC");
        assert_eq!(command_line(&["--scenario".into(), "a b".into()]), "dlock-torture --scenario 'a b'");
    }
}
