//! CPU time of processes from `/proc/PID/stat` (utime + stime), read at the
//! start and the end of the measured part.

use std::path::Path;

/// The kernel reports utime and stime in clock ticks of `USER_HZ`, which
/// the process learns from its auxiliary vector (`AT_CLKTCK`); 100 on
/// every common Linux when that cannot be read.
pub fn clock_ticks_per_second() -> u64 {
    std::fs::read("/proc/self/auxv")
        .ok()
        .and_then(|auxv| clock_ticks_from_auxv(&auxv))
        .unwrap_or(100)
}

/// `AT_CLKTCK` (17) from the auxiliary vector: native-endian pairs of
/// machine words, (type, value), ended by type 0.
fn clock_ticks_from_auxv(auxv: &[u8]) -> Option<u64> {
    const AT_CLKTCK: u64 = 17;
    const WORD: usize = std::mem::size_of::<usize>();
    let mut words = auxv.chunks_exact(WORD).map(|chunk| {
        let mut bytes = [0u8; WORD];
        bytes.copy_from_slice(chunk);
        usize::from_ne_bytes(bytes) as u64
    });
    while let (Some(kind), Some(value)) = (words.next(), words.next()) {
        match kind {
            0 => return None,
            AT_CLKTCK if value > 0 => return Some(value),
            _ => {}
        }
    }
    None
}

/// utime + stime in clock ticks, from the text of `/proc/PID/stat`. The
/// second field, the command name in parentheses, may itself hold spaces
/// and parentheses, so fields are counted after its last `)`: utime and
/// stime are fields 14 and 15 of the line, the 12th and 13th after it.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let (_, after_name) = stat.rsplit_once(')')?;
    let mut fields = after_name.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    utime.checked_add(stime)
}

/// utime + stime of `pid` in clock ticks, if the process still exists.
pub fn process_ticks(pid: u32) -> Option<u64> {
    read_ticks(&Path::new("/proc").join(pid.to_string()).join("stat"))
}

/// utime + stime of this process (every thread) in clock ticks.
pub fn own_ticks() -> Option<u64> {
    read_ticks(Path::new("/proc/self/stat"))
}

fn read_ticks(path: &Path) -> Option<u64> {
    parse_stat_ticks(&std::fs::read_to_string(path).ok()?)
}

#[cfg(test)]
mod tests;
