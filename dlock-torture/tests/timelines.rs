//! `--timelines` on a real run of the checker's self-test: the broken
//! plain-`DEL` lock's picture shows its overlaps in red, the real dlock's
//! control row (same workload) none, and the markdown block links both.

use std::process::Command;

#[test]
fn a_broken_lock_is_drawn_with_red_overlaps_and_the_real_one_without() {
    let dir = std::env::temp_dir().join(format!("dlock-torture-timelines-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let md = dir.join("block.md");
    std::fs::create_dir_all(&dir).expect("test dir");
    let out = Command::new(env!("CARGO_BIN_EXE_dlock-torture"))
        .args(["--short", "--scenario", "checker-self-test", "--seed", "7", "--timelines"])
        .arg(&dir)
        .arg("--markdown")
        .arg(&md)
        .output()
        .expect("run dlock-torture");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

    let broken = std::fs::read_to_string(dir.join("checker-self-test-broken-plain-del.svg")).expect("broken svg");
    assert!(broken.contains(r#"class="overlap""#) && broken.contains(">overlap</text>"), "no red overlap drawn");
    let control = std::fs::read_to_string(dir.join("checker-self-test-redis.svg")).expect("control svg");
    assert!(!control.contains(r#"class="overlap""#), "the real lock drawn with an overlap");
    // Its fixed 50 ms leases run out inside sections: stale writes are
    // refused (red marks), but no two owners hold at once.
    assert!(
        control.contains("no overlap") || control.contains(" 0 overlap(s)"),
        "the control's picture does not say it has no overlap"
    );
    for svg in [&broken, &control] {
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.len() < 200_000, "{} bytes", svg.len());
    }
    let block = std::fs::read_to_string(&md).expect("markdown block");
    assert!(block.contains("checker-self-test-broken-plain-del.svg)"), "{block}");
    let _ = std::fs::remove_dir_all(&dir);
}
