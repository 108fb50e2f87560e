//! RFC 3339 timestamps for manifests, without pulling in a date crate for one format.

use std::time::{SystemTime, UNIX_EPOCH};

/// `t` as `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds).
pub fn rfc3339_utc(t: SystemTime) -> String {
    // A clock before 1970 is a broken clock; 1970 is as good an answer as any.
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // u64 seconds / 86,400 is below 2^48: it fits an i64.
    let (y, m, d) = civil_from_days(i64::try_from(secs / 86_400).unwrap_or(i64::MAX));
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    // Day 1..=31 and month 1..=12 by the algorithm's ranges (doy 0..=365, mp 0..=11).
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).expect("a day of the month");
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).expect("a month");
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64) -> String {
        rfc3339_utc(UNIX_EPOCH + Duration::from_secs(secs))
    }

    #[test]
    fn known_dates() {
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(at(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
