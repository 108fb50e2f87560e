//! Kernel module metadata: which modules the guest needs, their dependencies
//! (modules.dep, or `.modinfo` when the package ships no modules.dep — Debian's
//! kernel packages leave that to depmod at install time), what is built in, and
//! the order to load them in.

use std::collections::{BTreeMap, HashMap, HashSet};

/// The modules the initramfs loads, in the order the agent should load them.
/// Dependencies are pulled in automatically; listing them keeps the order explicit.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_rng",
];

/// The root file system's driver; usually built in, loaded from the initramfs if not.
pub(crate) const ROOT_FS_MODULE: &str = "ext4";

/// A module's name as the kernel knows it: the file name without `.ko[.xz|.zst|.gz]`,
/// with `-` folded to `_` (the file `virtio-rng.ko` is the module `virtio_rng`).
pub(crate) fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = match file.find(".ko") {
        Some(i) => &file[..i],
        None => file,
    };
    normalise(stem)
}

pub(crate) fn normalise(name: &str) -> String {
    name.replace('-', "_")
}

/// One module in a [`DepDb`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    /// Path relative to `lib/modules/<release>/`, as modules.dep writes it.
    path: String,
    /// All dependencies (transitively), as paths, in modules.dep order: the last
    /// one is loaded first.
    deps: Vec<String>,
}

/// The contents of a modules.dep file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DepDb {
    by_name: BTreeMap<String, Entry>,
}

impl DepDb {
    /// Parses modules.dep (`path: dep dep ...` per line).
    pub(crate) fn parse(text: &str) -> Result<DepDb, String> {
        let mut by_name = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (path, deps) = line
                .split_once(':')
                .ok_or_else(|| format!("line {} has no ':': {line:?}", n + 1))?;
            let path = path.trim().to_string();
            let deps = deps.split_whitespace().map(str::to_string).collect();
            by_name.insert(module_name(&path), Entry { path, deps });
        }
        Ok(DepDb { by_name })
    }

    /// Builds the database from each module's direct dependencies (by name), as
    /// read from `.modinfo`; `direct` maps a name to (path, direct dependency names).
    pub(crate) fn from_direct(
        direct: &BTreeMap<String, (String, Vec<String>)>,
    ) -> Result<DepDb, String> {
        let mut by_name = BTreeMap::new();
        for (name, (path, _)) in direct {
            let mut order = Vec::new();
            let mut state = HashMap::new();
            for dep in &direct[name].1 {
                post_order(direct, dep, &mut state, &mut order)?;
            }
            order.retain(|d| d != name);
            // modules.dep lists dependencies so that the last one is loaded first.
            let deps = order.iter().rev().map(|d| direct[d].0.clone()).collect();
            by_name.insert(
                name.clone(),
                Entry {
                    path: path.clone(),
                    deps,
                },
            );
        }
        Ok(DepDb { by_name })
    }

    /// modules.dep text, sorted by path so that it is reproducible.
    pub(crate) fn render(&self) -> String {
        let mut entries: Vec<&Entry> = self.by_name.values().collect();
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let mut out = String::new();
        for e in entries {
            out.push_str(&e.path);
            out.push(':');
            for d in &e.deps {
                out.push(' ');
                out.push_str(d);
            }
            out.push('\n');
        }
        out
    }

    /// The names of all of a module's dependencies, the first to load first.
    pub(crate) fn deps_in_load_order(&self, name: &str) -> Option<Vec<String>> {
        let e = self.by_name.get(&normalise(name))?;
        Some(e.deps.iter().rev().map(|d| module_name(d)).collect())
    }

    fn by_path(&self, path: &str) -> Option<&Entry> {
        self.by_name
            .get(&module_name(path))
            .filter(|e| e.path == path)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    Visiting,
    Done,
}

/// Appends `name` and its direct dependencies to `order`, dependencies first.
fn post_order(
    direct: &BTreeMap<String, (String, Vec<String>)>,
    name: &str,
    state: &mut HashMap<String, Mark>,
    order: &mut Vec<String>,
) -> Result<(), String> {
    match state.get(name) {
        Some(Mark::Done) => return Ok(()),
        Some(Mark::Visiting) => return Err(format!("dependency cycle through {name}")),
        None => {}
    }
    let (_, deps) = direct
        .get(name)
        .ok_or_else(|| format!("needed module {name} is not in the package"))?;
    state.insert(name.to_string(), Mark::Visiting);
    for d in deps {
        post_order(direct, d, state, order)?;
    }
    state.insert(name.to_string(), Mark::Done);
    order.push(name.to_string());
    Ok(())
}

/// Names of built-in modules (modules.builtin lists them as paths).
#[derive(Debug, Clone, Default)]
pub(crate) struct Builtin(HashSet<String>);

impl Builtin {
    pub(crate) fn parse(text: &str) -> Builtin {
        Builtin(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(module_name)
                .collect(),
        )
    }

    /// Adds what the kernel config says is built in (`CONFIG_EXT4_FS=y`), as a
    /// second source for the root file system driver.
    pub(crate) fn add_from_config(&mut self, config: &str) {
        if config.lines().any(|l| l.trim() == "CONFIG_EXT4_FS=y") {
            self.0.insert(ROOT_FS_MODULE.to_string());
        }
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.0.contains(&normalise(name))
    }
}

/// A module to load: its name and its path under the modules directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Module {
    pub(crate) name: String,
    pub(crate) path: String,
}

/// The result of resolving the requested modules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Every module to load, dependencies before the modules that need them.
    pub(crate) load: Vec<Module>,
    /// Requested modules that are built into the kernel (nothing to load).
    pub(crate) builtin: Vec<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PlanError {
    /// Neither a module nor built in.
    Missing(String),
    /// modules.dep is inconsistent (a cycle, or a dependency without its own line).
    Broken(String),
}

/// Resolves `requested` to a load order: each module's dependency closure, in
/// request order, every module once, dependencies first.
pub(crate) fn plan(db: &DepDb, builtin: &Builtin, requested: &[&str]) -> Result<Plan, PlanError> {
    let mut plan = Plan::default();
    let mut state: HashMap<String, Mark> = HashMap::new();
    for req in requested {
        let name = normalise(req);
        if let Some(entry) = db.by_name.get(&name) {
            visit(db, &entry.path, &mut state, &mut plan.load)?;
        } else if builtin.contains(&name) {
            plan.builtin.push(name);
        } else {
            return Err(PlanError::Missing(name));
        }
    }
    Ok(plan)
}

fn visit(
    db: &DepDb,
    path: &str,
    state: &mut HashMap<String, Mark>,
    load: &mut Vec<Module>,
) -> Result<(), PlanError> {
    match state.get(path) {
        Some(Mark::Done) => return Ok(()),
        Some(Mark::Visiting) => {
            return Err(PlanError::Broken(format!(
                "dependency cycle through {path}"
            )))
        }
        None => {}
    }
    let entry = db.by_path(path).ok_or_else(|| {
        PlanError::Broken(format!("{path} is a dependency but has no line of its own"))
    })?;
    state.insert(path.to_string(), Mark::Visiting);
    // The last dependency listed is the first to load.
    for dep in entry.deps.iter().rev() {
        visit(db, dep, state, load)?;
    }
    state.insert(path.to_string(), Mark::Done);
    load.push(Module {
        name: module_name(path),
        path: path.to_string(),
    });
    Ok(())
}

/// The dependencies a module's `.modinfo` declares.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ModinfoDeps {
    /// `depends=`: symbols the module links against; it cannot load without them.
    pub(crate) hard: Vec<String>,
    /// The `pre:` part of `softdep=`: modules modprobe would load first. There is
    /// no modprobe in the initramfs, so they are loaded first when they exist.
    pub(crate) soft_pre: Vec<String>,
}

pub(crate) fn modinfo_deps(modinfo: &[u8]) -> ModinfoDeps {
    let mut deps = ModinfoDeps::default();
    for field in modinfo.split(|&b| b == 0) {
        let field = String::from_utf8_lossy(field);
        if let Some(v) = field.strip_prefix("depends=") {
            deps.hard.extend(
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(normalise),
            );
        } else if let Some(v) = field.strip_prefix("softdep=") {
            let mut in_pre = false;
            for tok in v.split_whitespace() {
                match tok {
                    "pre:" => in_pre = true,
                    "post:" => in_pre = false,
                    t if in_pre => deps.soft_pre.push(normalise(t)),
                    _ => {}
                }
            }
        }
    }
    deps
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/core/failover.ko:
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
";

    fn names(p: &Plan) -> Vec<&str> {
        p.load.iter().map(|m| m.name.as_str()).collect()
    }

    #[test]
    fn names_fold_dashes_and_suffixes() {
        assert_eq!(module_name("kernel/a/virtio-rng.ko"), "virtio_rng");
        assert_eq!(module_name("kernel/fs/ext4/ext4.ko.zst"), "ext4");
        assert_eq!(module_name("x.ko.xz"), "x");
    }

    #[test]
    fn closure_loads_dependencies_first() {
        let db = DepDb::parse(DEP).unwrap();
        let builtin = Builtin::parse("kernel/fs/ext4/ext4.ko\n");
        // Ask for the leaves only, in an awkward order: deps still come first.
        let p = plan(
            &db,
            &builtin,
            &["virtio_net", "virtio_blk", "virtio-rng", "ext4"],
        )
        .unwrap();
        assert_eq!(
            names(&p),
            [
                "virtio_ring",
                "virtio",
                "failover",
                "net_failover",
                "virtio_net",
                "virtio_blk",
                "virtio_rng"
            ]
        );
        assert_eq!(p.builtin, ["ext4"]);

        let p = plan(&db, &builtin, GUEST_MODULES).unwrap();
        assert_eq!(names(&p), GUEST_MODULES);
    }

    #[test]
    fn missing_and_broken() {
        let db = DepDb::parse(DEP).unwrap();
        assert_eq!(
            plan(&db, &Builtin::default(), &["ext4"]),
            Err(PlanError::Missing("ext4".into()))
        );
        let cyc = DepDb::parse("a.ko: b.ko\nb.ko: a.ko\n").unwrap();
        assert!(matches!(
            plan(&cyc, &Builtin::default(), &["a"]),
            Err(PlanError::Broken(_))
        ));
        let dangling = DepDb::parse("a.ko: b.ko\n").unwrap();
        assert!(matches!(
            plan(&dangling, &Builtin::default(), &["a"]),
            Err(PlanError::Broken(_))
        ));
        assert!(DepDb::parse("no colon here\n").is_err());
    }

    #[test]
    fn generated_db_matches_depmod_format() {
        let mut direct = BTreeMap::new();
        let mut add = |n: &str, p: &str, d: &[&str]| {
            direct.insert(
                n.to_string(),
                (p.to_string(), d.iter().map(|s| s.to_string()).collect()),
            );
        };
        add("virtio_ring", "kernel/drivers/virtio/virtio_ring.ko", &[]);
        add(
            "virtio",
            "kernel/drivers/virtio/virtio.ko",
            &["virtio_ring"],
        );
        add("failover", "kernel/net/core/failover.ko", &[]);
        add(
            "net_failover",
            "kernel/drivers/net/net_failover.ko",
            &["failover"],
        );
        add(
            "virtio_net",
            "kernel/drivers/net/virtio_net.ko",
            &["virtio_ring", "virtio", "net_failover"],
        );
        let db = DepDb::from_direct(&direct).unwrap();
        let text = db.render();
        assert!(text.contains(
            "kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n"
        ), "{text}");
        // Round trip through the text form.
        assert_eq!(DepDb::parse(&text).unwrap(), db);
        let p = plan(&db, &Builtin::default(), &["virtio_net"]).unwrap();
        assert_eq!(
            names(&p),
            [
                "virtio_ring",
                "virtio",
                "failover",
                "net_failover",
                "virtio_net"
            ]
        );

        let mut broken = direct.clone();
        broken.insert("x".into(), ("x.ko".into(), vec!["nope".into()]));
        assert!(DepDb::from_direct(&broken).is_err());
    }

    #[test]
    fn modinfo_fields() {
        let info = b"license=GPL\0depends=virtio_ring,virtio,net-failover\0softdep=pre: crc32c post: foo\0name=x\0\0";
        let d = modinfo_deps(info);
        assert_eq!(d.hard, ["virtio_ring", "virtio", "net_failover"]);
        assert_eq!(d.soft_pre, ["crc32c"]);
        assert_eq!(modinfo_deps(b"depends=\0"), ModinfoDeps::default());
    }

    #[test]
    fn builtin_from_config() {
        let mut b = Builtin::default();
        assert!(!b.contains("ext4"));
        b.add_from_config("# c\nCONFIG_EXT4_FS=y\n");
        assert!(b.contains("ext4"));
    }
}
