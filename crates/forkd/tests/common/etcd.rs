//! A real etcd cluster for the cluster tests: Debian's `etcd-server`, its members on
//! loopback ports, serving clients over TLS (with client certificates) signed by a CA
//! the test makes. Dropped, it stops every member and removes their data.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One member.
struct Member {
    name: String,
    client: String,
    child: Option<Child>,
}

/// An etcd cluster.
pub struct Etcd {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    initial: String,
}

/// The PEM files a client of the cluster needs.
pub struct ClientTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn write_pem(path: &Path, pem: &str) {
    std::fs::write(path, pem).unwrap();
}

impl Etcd {
    /// Starts `n` members and waits until each accepts connections.
    pub fn start(n: usize) -> Etcd {
        let dir = tempfile::tempdir().unwrap();
        make_certificates(dir.path());
        let ports: Vec<(String, String)> = (0..n)
            .map(|_| (super::free_port(), super::free_port()))
            .collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let members = ports
            .into_iter()
            .enumerate()
            .map(|(i, (client, _))| Member {
                name: format!("m{i}"),
                client,
                child: None,
            })
            .collect();
        let mut etcd = Etcd {
            dir,
            members,
            initial,
        };
        for i in 0..n {
            etcd.start_member(i);
        }
        etcd
    }

    /// `etcd://...` naming every member, for `forkd daemon --cluster`.
    pub fn url(&self) -> String {
        let clients: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        format!("etcd://{}", clients.join(","))
    }

    /// The files a client presents and trusts.
    pub fn client_tls(&self) -> ClientTls {
        ClientTls {
            ca: self.dir.path().join("ca.pem"),
            cert: self.dir.path().join("client.pem"),
            key: self.dir.path().join("client-key.pem"),
        }
    }

    /// Starts member `i` (again), on its data directory.
    pub fn start_member(&mut self, i: usize) {
        let d = self.dir.path();
        let m = &self.members[i];
        let peer = self
            .initial
            .split(',')
            .find_map(|e| e.strip_prefix(&format!("{}=", m.name)))
            .unwrap()
            .to_owned();
        let log = std::fs::File::create(d.join(format!("{}.log", m.name))).unwrap();
        let child = Command::new("etcd")
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(d.join(&m.name))
            .args(["--listen-client-urls", &format!("https://{}", m.client)])
            .args(["--advertise-client-urls", &format!("https://{}", m.client)])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "forkd-test"])
            .arg("--cert-file")
            .arg(d.join("server.pem"))
            .arg("--key-file")
            .arg(d.join("server-key.pem"))
            .arg("--client-cert-auth")
            .arg("--trusted-ca-file")
            .arg(d.join("ca.pem"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd from Debian's etcd-server (./dev setup installs it)");
        let client = m.client.clone();
        self.members[i].child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&client).is_err() {
            assert!(
                Instant::now() < deadline,
                "etcd member {i} did not listen: {}",
                self.log(i)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops member `i` (SIGTERM) and waits for it to exit.
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = super::signal(c.id(), nix::sys::signal::Signal::SIGTERM);
            let _ = c.wait();
        }
    }

    /// Member `i`'s log.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("m{i}.log"))).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
    }
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, in `dir`.
fn make_certificates(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    write_pem(&dir.join("ca.pem"), &ca_cert.pem());
    let issuer = Issuer::new(ca_params, ca_key);
    for (name, sans) in [
        (
            "server",
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
        ),
        ("client", vec!["forkd".to_owned()]),
    ] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(sans)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        write_pem(&dir.join(format!("{name}.pem")), &cert.pem());
        write_pem(&dir.join(format!("{name}-key.pem")), &key.serialize_pem());
    }
}
