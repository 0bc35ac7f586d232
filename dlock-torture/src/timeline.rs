//! `--timelines DIR`: one self-contained SVG per scenario row, drawn from
//! the same client histories the checkers read, so a person can see at a
//! glance what the numbers say: x is time, one lane per key, a bar per hold
//! (grant → release, loss or kill) coloured by client, the nemesis's faults
//! as shaded bands, and every overlap (two owners holding one key at once)
//! and every stale write the register refused in red, labelled.
//!
//! The SVG text is written here: no drawing dependency for a few shapes.
//! A picture is capped ([`MAX_LANES`] lanes, [`MAX_BARS`] bars) and says so
//! when it shows only part of the run.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::history::Event;

/// Lanes (keys) drawn; a run with more keys shows the first ones.
pub(crate) const MAX_LANES: usize = 16;
/// Hold bars drawn; a longer run shows a window of this many, starting
/// shortly before its first overlap (else refused stale write, else fault).
pub(crate) const MAX_BARS: usize = 400;
/// Labels written beside red marks; the rest are marked without text.
const MAX_LABELS: usize = 12;

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 64.0;
const LANE: f64 = 22.0;
const PALETTE: [&str; 10] =
    ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff7f0e", "#393b79"];

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Sets where the run's timelines go (`--timelines DIR`), creating it.
pub(crate) fn set_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    DIR.set(dir.to_owned()).map_err(|_| "--timelines given twice".to_owned())
}

/// The file name of a row's timeline: scenario and backend, lower-case
/// words joined by `-`.
pub(crate) fn file_name(scenario: &str, backend: &str) -> String {
    let mut slug = String::new();
    for c in format!("{scenario} {backend}").chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let mut slug = slug.trim_matches('-').to_owned();
    slug.truncate(80);
    format!("{}.svg", slug.trim_end_matches('-'))
}

/// Draws `events` for the row and writes it into the run's timeline
/// directory; returns the file's path, or `None` without `--timelines`.
pub(crate) fn write(scenario: &str, backend: &str, events: &[Event], run_end: u64) -> Result<Option<PathBuf>, String> {
    let Some(dir) = DIR.get() else { return Ok(None) };
    let path = dir.join(file_name(scenario, backend));
    let svg = draw(&format!("{scenario} [{backend}]"), events, run_end);
    std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(Some(path))
}

/// One hold as its client saw it.
#[derive(Debug, Clone)]
struct Hold {
    key: u32,
    pid: u32,
    owner: String,
    start: u64,
    end: u64,
}

/// A fault band: what, from, to (equal for an instant fault).
struct Band {
    what: &'static str,
    from: u64,
    to: u64,
}

/// The holds of a history, closed as the checker closes them: at the
/// release call, the process's kill, the end of a known validity, or the
/// end of the run.
fn holds(events: &[Event], run_end: u64) -> Vec<Hold> {
    let mut open: HashMap<(u32, u32), Hold> = HashMap::new();
    let mut done = Vec::new();
    for e in events {
        let id = (e.pid, e.task);
        match e.op.as_str() {
            "acq_ok" => {
                let hold = Hold {
                    key: e.key.unwrap_or(0),
                    pid: e.pid,
                    owner: e.owner.clone().unwrap_or_default(),
                    start: e.t,
                    end: e.vu.unwrap_or(u64::MAX),
                };
                if let Some(old) = open.insert(id, hold) {
                    done.push(old);
                }
            }
            "lost" => {
                if let Some(h) = open.get_mut(&id) {
                    h.end = h.end.min(e.vu.map_or(e.t, |vu| vu.min(e.t)));
                }
            }
            "rel_invoke" => {
                if let Some(mut h) = open.remove(&id) {
                    h.end = h.end.min(e.t);
                    done.push(h);
                }
            }
            "kill" => {
                let victims: Vec<(u32, u32)> = open.keys().filter(|(pid, _)| Some(*pid) == e.target).copied().collect();
                for v in victims {
                    if let Some(mut h) = open.remove(&v) {
                        h.end = h.end.min(e.t);
                        done.push(h);
                    }
                }
            }
            _ => {}
        }
    }
    done.extend(open.into_values().map(|mut h| {
        h.end = h.end.min(run_end);
        h
    }));
    // A hold whose validity ended before its grant was logged was never
    // believed at a moment the history can place (the checker skips it too).
    done.retain(|h| h.end > h.start);
    done.sort_by_key(|h| h.start);
    done
}

/// Overlaps: (key, from, to) where a hold began while another owner's hold
/// of the key was still open, as C1 counts them.
fn overlaps(holds: &[Hold]) -> Vec<(u32, u64, u64)> {
    let mut by_key: HashMap<u32, Vec<&Hold>> = HashMap::new();
    for h in holds {
        by_key.entry(h.key).or_default().push(h);
    }
    let mut out = Vec::new();
    for (key, list) in by_key {
        let mut active: Vec<&Hold> = Vec::new();
        for h in list {
            active.retain(|a| a.end > h.start);
            if let Some(until) = active.iter().filter(|a| a.owner != h.owner).map(|a| a.end.min(h.end)).max() {
                out.push((key, h.start, until));
            }
            active.push(h);
        }
    }
    out.sort_by_key(|o| o.1);
    out
}

/// The nemesis's faults as bands: stop → cont, partition → heal, slow →
/// fast; kills, restarts and flushes as instants.
fn bands(events: &[Event], run_end: u64) -> Vec<Band> {
    let mut open: HashMap<(&'static str, Option<u32>), u64> = HashMap::new();
    let mut out = Vec::new();
    for e in events {
        let (what, starts) = match e.op.as_str() {
            "stop" => ("pause", true),
            "cont" => ("pause", false),
            "partition" => ("cut", true),
            "heal" => ("cut", false),
            "slow" => ("slow", true),
            "fast" => ("slow", false),
            "kill" => {
                out.push(Band { what: "kill", from: e.t, to: e.t });
                continue;
            }
            "restart" => {
                out.push(Band { what: "restart", from: e.t, to: e.t });
                continue;
            }
            "flush" => {
                out.push(Band { what: "flush", from: e.t, to: e.t });
                continue;
            }
            _ => continue,
        };
        if starts {
            open.insert((what, e.target), e.t);
        } else if let Some(from) = open.remove(&(what, e.target)) {
            out.push(Band { what, from, to: e.t });
        }
    }
    out.extend(open.into_iter().map(|((what, _), from)| Band { what, from, to: run_end }));
    out.sort_by_key(|b| b.from);
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The SVG of one row.
pub(crate) fn draw(title: &str, events: &[Event], run_end: u64) -> String {
    let all = holds(events, run_end);
    let all_overlaps = overlaps(&all);
    let stale: Vec<(u32, u64)> = events
        .iter()
        .filter(|e| e.op == "write" && e.res.as_deref() == Some("stale"))
        .map(|e| (e.key.unwrap_or(0), e.t))
        .collect();
    let faults = bands(events, run_end);

    let mut keys: Vec<u32> = all.iter().map(|h| h.key).collect();
    keys.sort_unstable();
    keys.dedup();
    let lanes_total = keys.len();
    keys.truncate(MAX_LANES);
    let lane_of: HashMap<u32, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
    let in_lanes: Vec<&Hold> = all.iter().filter(|h| lane_of.contains_key(&h.key)).collect();

    // The window: everything, or MAX_BARS holds from shortly before the
    // first overlap or fault.
    let first = events.iter().map(|e| e.t).min().unwrap_or(0);
    let last = events.iter().map(|e| e.t).max().unwrap_or(first).max(first + 1);
    let (t0, t1, shown) = if in_lanes.len() <= MAX_BARS {
        (first, last, in_lanes.clone())
    } else {
        // The first red mark matters most, then the first fault.
        let focus = all_overlaps
            .first()
            .map(|o| o.1)
            .or_else(|| stale.iter().map(|(_, t)| *t).min())
            .or_else(|| faults.first().map(|b| b.from));
        let from = focus.map_or(first, |f| f.saturating_sub(500_000_000).max(first));
        let skip = in_lanes.iter().position(|h| h.end >= from).unwrap_or(0);
        let shown: Vec<&Hold> = in_lanes.iter().skip(skip).take(MAX_BARS).copied().collect();
        let to = shown.iter().map(|h| h.start).max().unwrap_or(last).max(from + 1);
        (from, to, shown)
    };
    let span = (t1 - t0) as f64;
    let plot = WIDTH - LEFT - RIGHT;
    let x = |t: u64| LEFT + (t.clamp(t0, t1) - t0) as f64 / span * plot;
    let height = TOP + LANE * keys.len().max(1) as f64 + 40.0;

    let mut colours: HashMap<u32, &str> = HashMap::new();
    let mut pids: Vec<u32> = all.iter().map(|h| h.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    for (i, pid) in pids.iter().enumerate() {
        colours.insert(*pid, PALETTE[i % PALETTE.len()]);
    }

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#fff"/>"##);
    let _ = writeln!(s, r#"<text x="{LEFT}" y="16" font-size="14" font-weight="bold">{}</text>"#, esc(title));
    let verdict = if all_overlaps.is_empty() && stale.is_empty() {
        "no overlap, no refused stale write".to_owned()
    } else {
        format!("{} overlap(s), {} stale write(s) refused (red)", all_overlaps.len(), stale.len())
    };
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="32">{} holds by {} clients on {} keys; {verdict}; faults shaded: {}</text>"#,
        all.len(),
        pids.len(),
        lanes_total,
        esc(&fault_summary(&faults))
    );
    let mut truncated = Vec::new();
    if lanes_total > keys.len() {
        truncated.push(format!("first {} of {lanes_total} keys", keys.len()));
    }
    if shown.len() < in_lanes.len() {
        truncated.push(format!(
            "{} of {} holds, {:.1}–{:.1} s",
            shown.len(),
            in_lanes.len(),
            (t0 - first) as f64 / 1e9,
            (t1 - first) as f64 / 1e9
        ));
    }
    if !truncated.is_empty() {
        let _ =
            writeln!(s, r##"<text x="{LEFT}" y="48" fill="#b00">truncated: showing {}</text>"##, truncated.join("; "));
    }
    // Time axis: about ten ticks in seconds from the run's first event.
    let step = nice_step(span / 1e9 / 10.0);
    let mut tick = ((t0 - first) as f64 / 1e9 / step).ceil() * step;
    let bottom = TOP + LANE * keys.len().max(1) as f64;
    while first as f64 + tick * 1e9 <= t1 as f64 {
        let tx = x(first + (tick * 1e9) as u64);
        let _ = writeln!(
            s,
            r##"<line x1="{tx:.1}" y1="{TOP}" x2="{tx:.1}" y2="{bottom}" stroke="#eee"/><text x="{tx:.1}" y="{:.1}" text-anchor="middle" fill="#555">{tick:.1} s</text>"##,
            bottom + 14.0
        );
        tick += step;
    }
    for (i, key) in keys.iter().enumerate() {
        let y = TOP + LANE * i as f64;
        let _ = writeln!(s, r##"<text x="4" y="{:.1}" fill="#333">key {key}</text>"##, y + 15.0);
    }
    for b in faults.iter().filter(|b| b.to >= t0 && b.from <= t1) {
        let (fill, w) = match b.what {
            "kill" | "restart" | "flush" => ("#444", 2.0_f64),
            "cut" => ("#ff7f0e", 0.0),
            "slow" => ("#ffbb78", 0.0),
            _ => ("#999", 0.0),
        };
        let (bx, bw) = (x(b.from), (x(b.to) - x(b.from)).max(w));
        let _ = writeln!(
            s,
            r#"<rect x="{bx:.1}" y="{TOP}" width="{bw:.1}" height="{:.1}" fill="{fill}" fill-opacity="0.25"><title>{}</title></rect>"#,
            bottom - TOP,
            b.what
        );
        let _ = writeln!(s, r##"<text x="{bx:.1}" y="{:.1}" fill="#555" font-size="9">{}</text>"##, TOP - 4.0, b.what);
    }
    for h in &shown {
        let Some(lane) = lane_of.get(&h.key) else { continue };
        let y = TOP + LANE * *lane as f64 + 4.0;
        let (hx, hw) = (x(h.start), (x(h.end) - x(h.start)).max(0.8));
        let _ = writeln!(
            s,
            r#"<rect x="{hx:.1}" y="{y:.1}" width="{hw:.1}" height="{:.1}" fill="{}"/>"#,
            LANE - 8.0,
            colours.get(&h.pid).copied().unwrap_or("#000")
        );
    }
    let mut labels = 0;
    for (key, from, to) in all_overlaps.iter().filter(|o| o.2 >= t0 && o.1 <= t1) {
        let Some(lane) = lane_of.get(key) else { continue };
        let y = TOP + LANE * *lane as f64 + 1.0;
        let (ox, ow) = (x(*from), (x(*to) - x(*from)).max(3.0));
        let _ = writeln!(
            s,
            r##"<rect class="overlap" x="{ox:.1}" y="{y:.1}" width="{ow:.1}" height="{:.1}" fill="#d62728" fill-opacity="0.6" stroke="#d62728"><title>overlap on key {key}: {:.0} ms</title></rect>"##,
            LANE - 2.0,
            (to - from) as f64 / 1e6
        );
        if labels < MAX_LABELS {
            labels += 1;
            let _ = writeln!(
                s,
                r##"<text x="{ox:.1}" y="{:.1}" fill="#d62728" font-weight="bold">overlap</text>"##,
                y - 1.0
            );
        }
    }
    let mut labels = 0;
    for (key, t) in stale.iter().filter(|(_, t)| *t >= t0 && *t <= t1) {
        let Some(lane) = lane_of.get(key) else { continue };
        let (sx, y) = (x(*t), TOP + LANE * *lane as f64 + LANE / 2.0);
        let _ = writeln!(
            s,
            r##"<path class="stale" d="M{:.1} {:.1}l8 8m0 -8l-8 8" stroke="#d62728" stroke-width="2"><title>stale write refused on key {key}</title></path>"##,
            sx - 4.0,
            y - 4.0
        );
        if labels < MAX_LABELS {
            labels += 1;
            let _ =
                writeln!(s, r##"<text x="{:.1}" y="{:.1}" fill="#d62728">stale refused</text>"##, sx + 6.0, y + 4.0);
        }
    }
    // Legend: which colour is which client process.
    let mut lx = LEFT;
    let _ = write!(s, r##"<text x="4" y="{:.1}" fill="#333">clients</text>"##, bottom + 32.0);
    for pid in pids.iter().take(PALETTE.len()) {
        let _ = write!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{:.1}" y="{:.1}">pid {pid}</text>"#,
            bottom + 23.0,
            colours.get(pid).copied().unwrap_or("#000"),
            lx + 13.0,
            bottom + 32.0
        );
        lx += 80.0;
    }
    s.push_str("\n</svg>\n");
    s
}

fn fault_summary(faults: &[Band]) -> String {
    if faults.is_empty() {
        return "none".to_owned();
    }
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for b in faults {
        match counts.iter_mut().find(|(w, _)| *w == b.what) {
            Some((_, n)) => *n += 1,
            None => counts.push((b.what, 1)),
        }
    }
    counts.iter().map(|(w, n)| format!("{n} {w}")).collect::<Vec<_>>().join(", ")
}

/// 1, 2 or 5 × a power of ten, at least `raw` seconds.
fn nice_step(raw: f64) -> f64 {
    let raw = raw.max(1e-3);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|s| *s >= raw).unwrap_or(10.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t_ms: u64, pid: u32, op: &str, owner: &str) -> Event {
        Event { t: t_ms * 1_000_000, pid, op: op.into(), key: Some(0), owner: Some(owner.into()), ..Event::default() }
    }

    /// Two owners holding key 0 at once are drawn as a labelled red
    /// overlap, a refused stale write as a red mark; a clean history of
    /// the same shape has neither.
    #[test]
    fn an_overlap_is_drawn_red_and_a_clean_history_has_none() {
        let mut stale = ev(7, 1, "write", "a");
        stale.res = Some("stale".into());
        stale.reg = Some("f".into());
        let broken = vec![
            ev(1, 1, "acq_ok", "a"),
            ev(5, 2, "acq_ok", "b"),
            stale,
            ev(8, 1, "rel_invoke", "a"),
            ev(9, 2, "rel_invoke", "b"),
        ];
        let svg = draw("broken", &broken, 10);
        assert_eq!(svg.matches(r#"class="overlap""#).count(), 1, "{svg}");
        assert_eq!(svg.matches(r#"class="stale""#).count(), 1, "{svg}");
        assert!(svg.contains(">overlap</text>") && svg.contains("1 overlap(s), 1 stale write(s) refused"), "{svg}");

        let clean = vec![
            ev(1, 1, "acq_ok", "a"),
            ev(4, 1, "rel_invoke", "a"),
            ev(5, 2, "acq_ok", "b"),
            ev(9, 2, "rel_invoke", "b"),
        ];
        let svg = draw("clean", &clean, 10);
        assert!(!svg.contains("overlap\"") && !svg.contains(r#"class="stale""#), "{svg}");
        assert!(svg.contains("no overlap, no refused stale write"), "{svg}");
    }

    /// Faults are shaded bands; a run with more holds than the cap says
    /// it is truncated and stays small.
    #[test]
    fn faults_are_bands_and_a_long_run_is_capped() {
        let mut events = Vec::new();
        for i in 0..2000u64 {
            events.push(ev(i * 10, 1 + (i % 3) as u32, "acq_ok", &format!("o{}", i % 3)));
            events.push(ev(i * 10 + 5, 1 + (i % 3) as u32, "rel_invoke", &format!("o{}", i % 3)));
        }
        events.push(Event { t: 3_000_000_000, op: "stop".into(), target: Some(1), ..Event::default() });
        events.push(Event { t: 4_000_000_000, op: "cont".into(), target: Some(1), ..Event::default() });
        events.sort_by_key(|e| e.t);
        let svg = draw("long", &events, 20_000_000_000);
        assert!(svg.contains("truncated: showing 400 of 2000 holds"), "{}", &svg[..600]);
        assert!(svg.contains("<title>pause</title>"));
        assert!(svg.len() < 100_000, "{}", svg.len());

        // An overlap late in a long run is inside the window drawn.
        // Between the holds at 15000–15005 and 15010–15015 ms.
        let late = 15_006u64;
        events.push(ev(late, 7, "acq_ok", "x"));
        events.push(ev(late + 1, 8, "acq_ok", "y"));
        events.push(ev(late + 2, 7, "rel_invoke", "x"));
        events.push(ev(late + 3, 8, "rel_invoke", "y"));
        events.sort_by_key(|e| e.t);
        let svg = draw("late overlap", &events, 20_000_000_000);
        assert_eq!(svg.matches(r#"class="overlap""#).count(), 1, "{}", &svg[..600]);
    }

    #[test]
    fn file_names_are_plain() {
        assert_eq!(
            file_name("restart-redis", "redis, no persistence, kill -9, immediate restart"),
            "restart-redis-redis-no-persistence-kill-9-immediate-restart.svg"
        );
    }
}
