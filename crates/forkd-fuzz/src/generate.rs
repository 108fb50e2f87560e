//! Generated inputs for the tests: deterministic mutations of a target's seed corpus
//! (bit flips, interesting bytes and numbers, truncation, deletion, duplication,
//! splicing, tokens of the formats), so that a CI run tries the same 10,000 inputs
//! every time and a failure reproduces. libFuzzer (`./dev fuzz`) explores further.

use crate::Target;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Bytes that decoders treat specially.
const BYTES: &[u8] = &[
    0, 1, 0x7f, 0x80, 0xff, b'/', b'.', b'\n', b'"', b'\\', b'0', b'7', b'{', b'}', b'[', b' ',
];

/// 32-bit numbers at the edges of what the formats allow (frame and envelope lengths,
/// the payload limit).
const NUMBERS: &[u32] = &[
    0,
    1,
    4,
    0x7f,
    0x100,
    0xffff,
    0x10_0000,
    0x10_0001,
    0x7fff_ffff,
    u32::MAX,
];

/// Fragments of the formats: paths, whiteouts, JSON, tar and layout names, handshakes.
const TOKENS: &[&[u8]] = &[
    b"../",
    b"/",
    b".wh.",
    b".wh..wh..opq",
    b"\"",
    b"null",
    b"[]",
    b"{}",
    b"\\u0000",
    b"\\ud800",
    b"1e999",
    b"-1",
    b"18446744073709551616",
    b"sha256:",
    b"blobs/sha256/",
    b"manifest.json",
    b"index.json",
    b"oci-layout",
    b"FORKD-HELLO ",
    b"FORKD-READY ",
    b"\xc3",
    b"=",
    b"&",
    b"%",
    b"\n[[",
    b"\x00\x00\x00\x00",
];

/// A deterministic stream of inputs for one target.
pub struct Generator<'a> {
    rng: fastrand::Rng,
    seeds: &'a [Vec<u8>],
    target: &'a Target,
}

impl<'a> Generator<'a> {
    /// Inputs for `target` made from `seeds`; the same `seed` gives the same inputs.
    pub fn new(target: &'a Target, seeds: &'a [Vec<u8>], seed: u64) -> Self {
        Generator {
            rng: fastrand::Rng::with_seed(seed),
            seeds,
            target,
        }
    }

    /// The next input.
    pub fn next_input(&mut self) -> Vec<u8> {
        let mut data = if self.seeds.is_empty() || self.rng.u8(..) < 8 {
            let len = self.rng.usize(..64);
            (0..len).map(|_| self.rng.u8(..)).collect()
        } else {
            self.seeds[self.rng.usize(..self.seeds.len())].clone()
        };
        for _ in 0..self.rng.usize(1..=4) {
            self.mutate(&mut data);
        }
        data.truncate(self.target.max_len);
        if let Some(at) = self.target.tar_at {
            fix_tar_checksums(&mut data, at);
        }
        data
    }

    fn pos(&mut self, data: &[u8]) -> usize {
        self.rng.usize(..=data.len())
    }

    fn mutate(&mut self, data: &mut Vec<u8>) {
        let rng = &mut self.rng;
        match rng.u8(..11) {
            0 if !data.is_empty() => {
                let i = rng.usize(..data.len());
                data[i] ^= 1 << rng.u8(..8);
            }
            1 if !data.is_empty() => {
                let i = rng.usize(..data.len());
                data[i] = BYTES[rng.usize(..BYTES.len())];
            }
            2 if !data.is_empty() => {
                let i = rng.usize(..data.len());
                data[i] = rng.u8(..);
            }
            3 => {
                let at = self.pos(data);
                data.truncate(at);
            }
            4 if !data.is_empty() => {
                let start = rng.usize(..data.len());
                let end = (start + rng.usize(1..=32)).min(data.len());
                data.drain(start..end);
            }
            5 if !data.is_empty() => {
                let start = rng.usize(..data.len());
                let end = (start + rng.usize(1..=64)).min(data.len());
                let chunk = data[start..end].to_vec();
                let at = self.pos(data);
                data.splice(at..at, chunk);
            }
            6 => {
                let n = rng.usize(1..=16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
                let at = self.pos(data);
                data.splice(at..at, bytes);
            }
            7 if !self.seeds.is_empty() => {
                let other = &self.seeds[rng.usize(..self.seeds.len())];
                let from = rng.usize(..=other.len());
                let at = self.pos(data);
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
            8 if data.len() >= 4 => {
                let i = rng.usize(..=data.len() - 4);
                let n = NUMBERS[rng.usize(..NUMBERS.len())];
                data[i..i + 4].copy_from_slice(&n.to_be_bytes());
            }
            9 => {
                let token = TOKENS[rng.usize(..TOKENS.len())];
                let at = self.pos(data);
                data.splice(at..at, token.iter().copied());
            }
            _ => {
                // A digit changed: sizes, modes and lengths written as text (JSON, tar's
                // octal fields, TOML).
                let digits: Vec<usize> = (0..data.len())
                    .filter(|i| data[*i].is_ascii_digit())
                    .collect();
                if !digits.is_empty() {
                    let i = digits[rng.usize(..digits.len())];
                    data[i] = b'0' + rng.u8(..10);
                }
            }
        }
    }
}

/// Recomputes the checksum of every ustar or GNU header at 512-byte boundaries from
/// `at`, so that a mutated header is read rather than refused for its checksum.
pub fn fix_tar_checksums(data: &mut [u8], at: usize) {
    let mut off = at;
    while off + 512 <= data.len() {
        let block = &mut data[off..off + 512];
        if &block[257..262] == b"ustar" {
            block[148..156].fill(b' ');
            let sum: u32 = block.iter().map(|b| u32::from(*b)).sum();
            let text = format!("{sum:06o}\0 ");
            block[148..156].copy_from_slice(&text.as_bytes()[..8]);
        }
        off += 512;
    }
}

/// The seed corpus of `target`: `corpus/<target>/*`, by name.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .map(|it| {
            it.flatten()
                .filter_map(|e| Some((e.path(), std::fs::read(e.path()).ok()?)))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// A seed for the generator from the target's name, so each target's inputs differ
/// and stay the same from run to run.
pub fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Runs `target` on `input`; on a panic, saves the input in `crashes` (named by its
/// hash), says where and how to keep it as a regression, and panics again.
pub fn run_one(target: &Target, input: &[u8], what: &str, crashes: &Path) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (target.run)(input))) {
        let hex: String = {
            use sha2::Digest as _;
            sha2::Sha256::digest(input)[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        let _ = std::fs::create_dir_all(crashes);
        let file = crashes.join(format!("crash-{}-{hex}", target.name));
        let saved = std::fs::write(&file, input).is_ok();
        eprintln!(
            "target {} failed on {what} ({} bytes){}: copy it into crates/forkd-fuzz/corpus/{}/ and add a regression test (docs/fuzzing.md)",
            target.name,
            input.len(),
            if saved { format!(", saved as {}", file.display()) } else { String::new() },
            target.name,
        );
        std::panic::resume_unwind(panic);
    }
}

/// Runs `target` over its corpus and then `count` generated inputs; returns how many
/// inputs ran.
pub fn run_target(target: &Target, count: usize, crashes: &Path) -> usize {
    let corpus = corpus(target.name);
    assert!(
        !corpus.is_empty(),
        "target {} has no seed corpus in corpus/{}",
        target.name,
        target.name
    );
    for (path, bytes) in &corpus {
        run_one(target, bytes, &path.display().to_string(), crashes);
    }
    let seeds: Vec<Vec<u8>> = corpus.into_iter().map(|(_, b)| b).collect();
    let mut gen = Generator::new(target, &seeds, seed_of(target.name));
    for i in 0..count {
        let input = gen.next_input();
        run_one(target, &input, &format!("generated input {i}"), crashes);
    }
    seeds.len() + count
}
