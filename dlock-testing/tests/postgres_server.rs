//! The PostgreSQL cluster of the tests: it starts, answers, keeps its data
//! across a stop and a crash, and stops.

use std::time::{Duration, Instant};

use dlock_testing::PostgresServer;

#[test]
fn a_cluster_starts_keeps_its_data_across_restarts_and_stops() {
    let mut pg = PostgresServer::start();
    assert_eq!(pg.psql("SELECT 1 + 1"), "2");
    pg.psql("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)");
    pg.stop();
    let down = std::net::TcpStream::connect(("127.0.0.1", pg.port()));
    assert!(down.is_err(), "the server still listens after a stop");
    pg.start_again();
    assert_eq!(pg.psql("SELECT n FROM kept"), "7");
    pg.psql("INSERT INTO kept VALUES (8)");
    pg.crash();
    pg.start_again();
    assert_eq!(pg.psql("SELECT sum(n) FROM kept"), "15", "committed rows survive a crash");
    let port = pg.port();
    drop(pg);
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "stopped on drop");
}

/// A cluster left running by a test process that died without dropping it
/// is stopped and deleted by the next start, and one whose process lives
/// is not.
#[test]
fn a_cluster_left_by_a_dead_process_is_reaped_at_the_next_start() {
    // A process id that no process has now: one that has exited.
    let mut gone = std::process::Command::new("true").spawn().expect("run true");
    gone.wait().expect("wait for true");
    let tmp = std::env::temp_dir();
    let left = PostgresServer::start();
    let (port, postmaster) = (left.port(), left.pids()[0]);
    let ours = tmp.join(format!("dlock-pg-{}-{port}", std::process::id()));
    let orphan = tmp.join(format!("dlock-pg-{}-{port}", gone.id()));
    // As if its process had been killed: never dropped, its directory
    // named after a process that no longer runs.
    std::mem::forget(left);
    std::fs::rename(&ours, &orphan).expect("rename the cluster's directory");
    let alive = PostgresServer::start();
    assert!(!orphan.exists(), "the orphan's directory is still there");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{postmaster}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!std::path::Path::new(&format!("/proc/{postmaster}")).exists(), "the orphan's server still runs");
    // A cluster of a live process (this one) is left alone by a third start.
    let third = PostgresServer::start();
    assert_eq!(alive.psql("SELECT 2"), "2", "a live process' cluster was reaped");
    drop(third);
}

/// Every cluster is a copy of one `initdb` per process, and a copy of its
/// own: what one cluster writes, another does not see, and the template
/// is this process's, named so that the next process reaps it.
#[test]
fn clusters_are_copies_of_one_initdb_and_independent() {
    let (a, b) = (PostgresServer::start(), PostgresServer::start());
    a.psql("CREATE TABLE only_in_a (x int)");
    assert_eq!(a.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_a'"), "1");
    assert_eq!(b.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_a'"), "0");
    let template = std::env::temp_dir().join(format!("dlock-pg-{}-template", std::process::id()));
    assert!(template.join("data").join("PG_VERSION").exists(), "no template at {}", template.display());
}
