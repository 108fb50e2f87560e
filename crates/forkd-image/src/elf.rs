//! The little ELF reading this crate needs: is an executable static (no PT_INTERP),
//! and what is in a kernel module's `.modinfo` section. 64-bit little-endian only,
//! since the guest is x86-64.

const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const EM_X86_64: u16 = 62;
const ET_REL: u16 = 1;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const PT_INTERP: u32 = 3;
const HEADER_LEN: usize = 64;

/// The fields of the ELF header that the checks below use.
#[derive(Debug, Clone, Copy)]
struct Header {
    e_type: u16,
    e_machine: u16,
    phoff: u64,
    phentsize: u16,
    phnum: u16,
    shoff: u64,
    shentsize: u16,
    shnum: u16,
    shstrndx: u16,
}

fn u16_at(d: &[u8], off: usize) -> Option<u16> {
    d.get(off..off.checked_add(2)?)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
}

fn u32_at(d: &[u8], off: usize) -> Option<u32> {
    d.get(off..off.checked_add(4)?)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u64_at(d: &[u8], off: usize) -> Option<u64> {
    let b = d.get(off..off.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Some(u64::from_le_bytes(a))
}

fn header(d: &[u8]) -> Result<Header, String> {
    if d.len() < HEADER_LEN || &d[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if d[4] != ELFCLASS64 || d[5] != ELFDATA2LSB {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let field = |v: Option<u16>| v.ok_or_else(|| "truncated ELF header".to_string());
    let h = Header {
        e_type: field(u16_at(d, 16))?,
        e_machine: field(u16_at(d, 18))?,
        phoff: u64_at(d, 32).ok_or("truncated ELF header")?,
        shoff: u64_at(d, 40).ok_or("truncated ELF header")?,
        phentsize: field(u16_at(d, 54))?,
        phnum: field(u16_at(d, 56))?,
        shentsize: field(u16_at(d, 58))?,
        shnum: field(u16_at(d, 60))?,
        shstrndx: field(u16_at(d, 62))?,
    };
    if h.e_machine != EM_X86_64 {
        return Err(format!("built for machine {}, not x86-64", h.e_machine));
    }
    Ok(h)
}

/// What [`check_static_executable`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Linkage {
    Static,
    /// Has a PT_INTERP program header: needs a dynamic loader at run time.
    Dynamic,
}

/// Checks that `d` is an x86-64 executable (ET_EXEC, or ET_DYN for static-pie)
/// and whether it asks for a program interpreter. `Err` says why it is not an
/// executable at all.
pub(crate) fn check_static_executable(d: &[u8]) -> Result<Linkage, String> {
    let h = header(d)?;
    if h.e_type != ET_EXEC && h.e_type != ET_DYN {
        return Err(format!("ELF type {} is not an executable", h.e_type));
    }
    if h.phnum == 0 {
        return Err("no program headers".into());
    }
    if usize::from(h.phentsize) < 56 {
        return Err("program header entries are too small".into());
    }
    for i in 0..u64::from(h.phnum) {
        let off = h
            .phoff
            .checked_add(i * u64::from(h.phentsize))
            .and_then(|o| usize::try_from(o).ok())
            .ok_or("program header offset overflows")?;
        let p_type = u32_at(d, off).ok_or("program headers are truncated")?;
        if p_type == PT_INTERP {
            return Ok(Linkage::Dynamic);
        }
    }
    Ok(Linkage::Static)
}

/// The contents of the section called `name` of a relocatable object (a kernel
/// module), or None if it has no such section.
pub(crate) fn relocatable_section<'a>(d: &'a [u8], name: &str) -> Result<Option<&'a [u8]>, String> {
    let h = header(d)?;
    if h.e_type != ET_REL {
        return Err(format!("ELF type {} is not a relocatable object", h.e_type));
    }
    if usize::from(h.shentsize) < 64 {
        return Err("section header entries are too small".into());
    }
    // (offset, size) of section i.
    let section = |i: u16| -> Result<(usize, usize, u32), String> {
        let base = h
            .shoff
            .checked_add(u64::from(i) * u64::from(h.shentsize))
            .and_then(|o| usize::try_from(o).ok())
            .ok_or("section header offset overflows")?;
        let name_off = u32_at(d, base).ok_or("section headers are truncated")?;
        let off = u64_at(d, base + 24).ok_or("section headers are truncated")?;
        let size = u64_at(d, base + 32).ok_or("section headers are truncated")?;
        let off = usize::try_from(off).map_err(|_| "section offset overflows")?;
        let size = usize::try_from(size).map_err(|_| "section size overflows")?;
        Ok((off, size, name_off))
    };
    let bytes = |off: usize, size: usize| {
        off.checked_add(size)
            .and_then(|end| d.get(off..end))
            .ok_or_else(|| "section lies outside the file".to_string())
    };
    let table_end = u64::from(h.shnum)
        .checked_mul(u64::from(h.shentsize))
        .and_then(|n| n.checked_add(h.shoff));
    match table_end {
        Some(end) if end <= d.len() as u64 => {}
        _ => return Err("section headers are truncated".into()),
    }
    if h.shstrndx >= h.shnum {
        return Err("no section name table".into());
    }
    let (stroff, strsize, _) = section(h.shstrndx)?;
    let strtab = bytes(stroff, strsize)?;
    for i in 0..h.shnum {
        let (off, size, name_off) = section(i)?;
        let name_start = usize::try_from(name_off).map_err(|_| "name offset overflows")?;
        let Some(rest) = strtab.get(name_start..) else {
            continue;
        };
        let sname = rest.split(|&b| b == 0).next().unwrap_or_default();
        if sname == name.as_bytes() {
            return bytes(off, size).map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A minimal ELF64 header plus `phdrs` program headers of the given types.
    pub(crate) fn fabricate_executable(e_type: u16, phdr_types: &[u32]) -> Vec<u8> {
        let mut d = vec![0u8; HEADER_LEN];
        d[..4].copy_from_slice(b"\x7fELF");
        d[4] = ELFCLASS64;
        d[5] = ELFDATA2LSB;
        d[6] = 1;
        d[16..18].copy_from_slice(&e_type.to_le_bytes());
        d[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());
        d[32..40].copy_from_slice(&(HEADER_LEN as u64).to_le_bytes());
        d[54..56].copy_from_slice(&56u16.to_le_bytes());
        let phnum = u16::try_from(phdr_types.len()).expect("a test ELF has few headers");
        d[56..58].copy_from_slice(&phnum.to_le_bytes());
        for t in phdr_types {
            let mut ph = vec![0u8; 56];
            ph[..4].copy_from_slice(&t.to_le_bytes());
            d.extend(ph);
        }
        d
    }

    #[test]
    fn static_and_dynamic() {
        const PT_LOAD: u32 = 1;
        const PT_DYNAMIC: u32 = 2;
        let st = fabricate_executable(ET_EXEC, &[PT_LOAD, PT_LOAD]);
        assert_eq!(check_static_executable(&st), Ok(Linkage::Static));
        // static-pie: ET_DYN with a PT_DYNAMIC but no interpreter.
        let pie = fabricate_executable(ET_DYN, &[PT_LOAD, PT_DYNAMIC]);
        assert_eq!(check_static_executable(&pie), Ok(Linkage::Static));
        let dy = fabricate_executable(ET_DYN, &[PT_LOAD, PT_INTERP, PT_DYNAMIC]);
        assert_eq!(check_static_executable(&dy), Ok(Linkage::Dynamic));
    }

    #[test]
    fn rejects_non_executables() {
        assert!(check_static_executable(b"#!/bin/sh\necho hi\n").is_err());
        assert!(check_static_executable(&fabricate_executable(ET_REL, &[1])).is_err());
        let mut arm = fabricate_executable(ET_EXEC, &[1]);
        arm[18] = 183; // EM_AARCH64
        assert!(check_static_executable(&arm)
            .unwrap_err()
            .contains("x86-64"));
        // Program header count pointing past the end of the file.
        let mut short = fabricate_executable(ET_EXEC, &[1]);
        short[56] = 9;
        assert!(check_static_executable(&short).is_err());
    }

    /// A relocatable ELF with sections: null, .modinfo (`modinfo`), .shstrtab.
    pub(crate) fn fabricate_module(modinfo: &[u8]) -> Vec<u8> {
        let shstrtab = b"\0.modinfo\0.shstrtab\0";
        let mut d = vec![0u8; HEADER_LEN];
        d[..4].copy_from_slice(b"\x7fELF");
        d[4] = ELFCLASS64;
        d[5] = ELFDATA2LSB;
        d[16..18].copy_from_slice(&ET_REL.to_le_bytes());
        d[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());
        let modinfo_off = d.len();
        d.extend_from_slice(modinfo);
        let str_off = d.len();
        d.extend_from_slice(shstrtab);
        let shoff = d.len();
        d[40..48].copy_from_slice(&(shoff as u64).to_le_bytes());
        d[58..60].copy_from_slice(&64u16.to_le_bytes());
        d[60..62].copy_from_slice(&3u16.to_le_bytes());
        d[62..64].copy_from_slice(&2u16.to_le_bytes());
        let sh = |name: u32, off: usize, size: usize| {
            let mut s = vec![0u8; 64];
            s[..4].copy_from_slice(&name.to_le_bytes());
            s[24..32].copy_from_slice(&(off as u64).to_le_bytes());
            s[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            s
        };
        d.extend(sh(0, 0, 0));
        d.extend(sh(1, modinfo_off, modinfo.len()));
        d.extend(sh(10, str_off, shstrtab.len()));
        d
    }

    #[test]
    fn finds_a_section() {
        let m = fabricate_module(b"name=x\0depends=a,b\0");
        assert_eq!(
            relocatable_section(&m, ".modinfo").unwrap(),
            Some(&b"name=x\0depends=a,b\0"[..])
        );
        assert_eq!(relocatable_section(&m, ".text").unwrap(), None);
        assert!(relocatable_section(&m[..m.len() - 10], ".modinfo").is_err());
    }
}
