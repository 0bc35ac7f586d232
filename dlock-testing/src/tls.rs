//! A `redis-server` that speaks TLS, with certificates made at test time by
//! the `openssl` command-line tool in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::port::free_port;
use crate::RedisServer;

/// A throw-away PKI in a temporary directory (removed on drop): a CA, a
/// server certificate for `127.0.0.1` / `localhost` signed by it, a client
/// certificate signed by it, and a second, unrelated CA to show that
/// verification really happens. Keys are P-256, PEM, PKCS#8.
///
/// ```no_run
/// let certs = dlock_testing::TestCertificates::generate();
/// assert!(certs.ca_cert().exists() && certs.other_ca_cert().exists());
/// ```
#[derive(Debug)]
pub struct TestCertificates {
    dir: PathBuf,
}

impl TestCertificates {
    /// Makes the certificates.
    ///
    /// # Panics
    ///
    /// When the `openssl` tool is missing or fails (the README's test
    /// command installs it).
    pub fn generate() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("dlock-tls-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a directory for test certificates");
        let certs = TestCertificates { dir };
        certs.self_signed_ca("ca", "dlock test CA");
        certs.self_signed_ca("other-ca", "dlock unrelated CA");
        certs.signed_by_ca(
            "server",
            "127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        );
        certs.signed_by_ca("client", "dlock test client", "extendedKeyUsage=clientAuth\n");
        certs
    }

    /// The CA that signed the server and client certificates (PEM).
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// A CA that signed nothing here: trusting only it must fail.
    pub fn other_ca_cert(&self) -> PathBuf {
        self.dir.join("other-ca.crt")
    }

    /// The server certificate (for `127.0.0.1` and `localhost`).
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    /// The server's private key.
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// A client certificate signed by [`ca_cert`](Self::ca_cert).
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.crt")
    }

    /// The client certificate's private key (PKCS#8).
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// The directory, for extra files a test writes (e.g. a malformed PEM).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn self_signed_ca(&self, name: &str, cn: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-new",
            "-nodes",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
    }

    fn signed_by_ca(&self, name: &str, cn: &str, extensions: &str) {
        let ext = format!("{name}.ext");
        std::fs::write(self.dir.join(&ext), format!("basicConstraints=CA:FALSE\n{extensions}"))
            .expect("write a certificate extension file");
        self.openssl(&[
            "req",
            "-new",
            "-nodes",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run `openssl` ({e}): the TLS tests make their certificates with it; `apt-get install -y openssl`")
            });
        assert!(out.status.success(), "openssl {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A [`RedisServer`] that also listens with TLS on a second port, using a
/// fresh [`TestCertificates`]. The plain-text port stays open for the test's
/// own assertions ([`RedisServer::connection`], `INFO`, `CLIENT LIST`); the
/// code under test gets [`tls_url`](Self::tls_url).
///
/// ```no_run
/// let redis = dlock_testing::TlsRedisServer::start();
/// let url = redis.tls_url(); // rediss://127.0.0.1:<port>
/// let ca = redis.certs().ca_cert();
/// ```
#[derive(Debug)]
pub struct TlsRedisServer {
    // Declared first: the server stops before its certificates are deleted.
    server: RedisServer,
    tls_port: u16,
    certs: TestCertificates,
}

impl TlsRedisServer {
    /// Starts a server that does not ask clients for a certificate.
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`] and [`TestCertificates::generate`].
    pub fn start() -> Self {
        Self::start_with_client_auth(false)
    }

    /// Starts a server with `tls-auth-clients yes` when `required`: only
    /// clients presenting a certificate signed by the test CA get in.
    ///
    /// # Panics
    ///
    /// As [`TlsRedisServer::start`].
    pub fn start_with_client_auth(required: bool) -> Self {
        let certs = TestCertificates::generate();
        let tls_port = free_port();
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let (port, cert, key, ca) =
            (tls_port.to_string(), path(certs.server_cert()), path(certs.server_key()), path(certs.ca_cert()));
        let server = RedisServer::start_with(&[
            "--tls-port",
            &port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            if required { "yes" } else { "no" },
        ]);
        TlsRedisServer { server, tls_port, certs }
    }

    /// `rediss://127.0.0.1:<tls port>`.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }

    /// The TLS port.
    pub fn tls_port(&self) -> u16 {
        self.tls_port
    }

    /// The certificates the server uses.
    pub fn certs(&self) -> &TestCertificates {
        &self.certs
    }

    /// The server, for plain-text assertions and fault injection.
    pub fn server(&self) -> &RedisServer {
        &self.server
    }

    /// Kills the server with SIGKILL, as [`RedisServer::kill`].
    pub fn kill(&mut self) {
        self.server.kill();
    }

    /// The local ports of the server's client connections (`laddr` in
    /// `CLIENT LIST`): which listener, TLS or plain, each client came in on.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub fn client_listener_ports(&self) -> Vec<u16> {
        let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut self.server.connection()).expect("CLIENT LIST");
        list.lines()
            .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("laddr=")))
            .filter_map(|addr| addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()))
            .collect()
    }
}
