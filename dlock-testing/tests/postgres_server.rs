//! The PostgreSQL cluster of the tests: it starts, answers, keeps its data
//! across a stop and a crash, and stops.

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
