// The duration grammar's cases, one table for both of its parsers: core's `parse_duration`
// (run time) and the attribute's `parse_duration_ms` (compile time, `idempotent-macros`).
// Each includes this file from a `#[cfg(test)]` test and checks its parser against every row,
// so the two cannot drift. (A test-only `include!`: neither published crate needs the file.)
//
// A row: (input, the duration in milliseconds or why both refuse it, the attribute's range).
// - `Ok(ms)`: both parse it to `ms` milliseconds, unless the attribute's range refuses it;
// - `Err(why)`: both refuse it, with a message containing `why`;
// - the range (100ms ..= 365d, the runtime configuration's bounds) is the attribute's own
//   check: `""` within it (or refused anyway), `"short"` or `"long"` outside it, which core
//   accepts and the attribute refuses.
&[
    // Each unit.
    ("500ms", Ok(500), ""),
    ("30s", Ok(30_000), ""),
    ("15m", Ok(900_000), ""),
    ("24h", Ok(86_400_000), ""),
    ("7d", Ok(604_800_000), ""),
    ("1s", Ok(1_000), ""),
    ("90s", Ok(90_000), ""),
    ("007s", Ok(7_000), ""),
    // The attribute's range, at and past both ends.
    ("100ms", Ok(100), ""),
    ("99ms", Ok(99), "short"),
    ("1ms", Ok(1), "short"),
    ("365d", Ok(31_536_000_000), ""),
    ("8760h", Ok(31_536_000_000), ""),
    ("8761h", Ok(31_539_600_000), "long"),
    ("366d", Ok(31_622_400_000), "long"),
    ("18446744073709551615ms", Ok(u64::MAX), "long"),
    // Malformed: empty, no digits, no unit, another unit, not a whole number, a sign,
    // whitespace, two units, digits that are not ASCII.
    ("", Err("is not a duration"), ""),
    ("ms", Err("is not a duration"), ""),
    ("s", Err("is not a duration"), ""),
    ("10", Err("is not a duration"), ""),
    ("10S", Err("is not a duration"), ""),
    ("10sec", Err("is not a duration"), ""),
    ("10us", Err("is not a duration"), ""),
    ("1w", Err("is not a duration"), ""),
    ("1.5h", Err("is not a duration"), ""),
    (".5s", Err("is not a duration"), ""),
    ("1e3ms", Err("is not a duration"), ""),
    ("+1s", Err("is not a duration"), ""),
    ("-1s", Err("is not a duration"), ""),
    (" 10s", Err("is not a duration"), ""),
    ("10s ", Err("is not a duration"), ""),
    ("10 s", Err("is not a duration"), ""),
    ("1h30m", Err("is not a duration"), ""),
    ("١s", Err("is not a duration"), ""),
    // Zero.
    ("0s", Err("is zero"), ""),
    ("0ms", Err("is zero"), ""),
    ("000d", Err("is zero"), ""),
    // Too many digits for 64 bits, and a product that overflows them.
    ("18446744073709551616ms", Err("is too large"), ""),
    ("99999999999999999999d", Err("is too large"), ""),
    ("999999999999999999d", Err("is too large"), ""),
    ("18446744073709552s", Err("is too large"), ""),
]
