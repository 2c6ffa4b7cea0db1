//! The one duration grammar: `"500ms"`, `"30s"`, `"15m"`, `"24h"`, `"7d"`.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    /// Not `<digits><unit>` with a unit of `ms`, `s`, `m`, `h` or `d`.
    #[error(
        "`{input}` is not a duration; write a whole number and a unit: `500ms`, `30s`, `15m`, `24h` or `7d`"
    )]
    Malformed {
        /// The refused text.
        input: String,
    },
    /// The duration is zero.
    #[error("the duration `{input}` is zero; it must be at least 1ms")]
    Zero {
        /// The refused text.
        input: String,
    },
    /// The duration does not fit in 64-bit milliseconds.
    #[error("the duration `{input}` is too large")]
    Overflow {
        /// The refused text.
        input: String,
    },
}

/// Parses `<whole number><unit>`, unit one of `ms`, `s`, `m`, `h`, `d`; zero is refused.
///
/// The `#[idempotent]` attribute parses its literals with the same grammar at compile time.
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::parse_duration;
///
/// assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
/// assert_eq!(parse_duration("24h")?, Duration::from_secs(86_400));
/// assert!(parse_duration("0s").is_err());
/// assert!(parse_duration("1.5h").is_err());
/// # Ok::<(), idempotent_core::DurationError>(())
/// ```
///
/// # Errors
/// [`DurationError`] for anything else.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let malformed = || DurationError::Malformed {
        input: input.to_owned(),
    };
    let digits_end = input
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(malformed)?;
    let (digits, unit) = input.split_at(digits_end);
    if digits.is_empty() {
        return Err(malformed());
    }
    let millis_per: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(malformed()),
    };
    let overflow = || DurationError::Overflow {
        input: input.to_owned(),
    };
    let n: u64 = digits.parse().map_err(|_| overflow())?;
    let millis = n.checked_mul(millis_per).ok_or_else(overflow)?;
    if millis == 0 {
        return Err(DurationError::Zero {
            input: input.to_owned(),
        });
    }
    Ok(Duration::from_millis(millis))
}

/// Formats a duration in the same grammar, choosing the largest exact unit (`1d`, `1500ms`).
pub(crate) fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= per && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_picks_the_largest_exact_unit() {
        assert_eq!(format_duration(Duration::from_secs(86_400)), "1d");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }

    proptest::proptest! {
        /// Any whole number of milliseconds up to a year formats into text that parses back.
        #[test]
        fn formatted_durations_parse_back(ms in 1_u64..=365 * 86_400_000) {
            let d = Duration::from_millis(ms);
            proptest::prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }

    #[test]
    fn grammar() {
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        for bad in [
            "", "s", "10", "10 s", " 10s", "10S", "-1s", "1.5s", "10sec", "1h30m",
        ] {
            assert!(
                matches!(parse_duration(bad), Err(DurationError::Malformed { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_duration("0ms"),
            Err(DurationError::Zero { .. })
        ));
        assert!(matches!(
            parse_duration("99999999999999999999d"),
            Err(DurationError::Overflow { .. })
        ));
        assert!(matches!(
            parse_duration("999999999999999999d"),
            Err(DurationError::Overflow { .. })
        ));
        for s in ["1d", "2h", "3m", "4s", "5ms", "90s"] {
            assert_eq!(
                parse_duration(&format_duration(parse_duration(s).unwrap())).unwrap(),
                parse_duration(s).unwrap()
            );
        }
    }
}

/// The grammar's cases, shared with the `#[idempotent]` attribute's compile-time parser (its
/// `args.rs` reads the same table), so the two cannot drift.
#[cfg(test)]
mod shared_cases {
    use super::*;

    #[test]
    fn parse_duration_agrees_with_the_attribute() {
        let cases: &[(&str, Result<u64, &str>, &str)] = include!("../../tests/duration_cases.rs");
        for &(input, parsed, range) in cases {
            let got = parse_duration(input);
            match parsed {
                // The grammar has no range (the runtime configuration checks its bounds
                // itself): rows the attribute refuses as `short` or `long` parse here.
                Ok(ms) => {
                    assert!(matches!(range, "" | "short" | "long"), "{input:?}");
                    assert_eq!(got, Ok(Duration::from_millis(ms)), "{input:?}");
                }
                Err(why) => {
                    let kind_agrees = match why {
                        "is not a duration" => matches!(got, Err(DurationError::Malformed { .. })),
                        "is zero" => matches!(got, Err(DurationError::Zero { .. })),
                        "is too large" => matches!(got, Err(DurationError::Overflow { .. })),
                        other => panic!("{input:?}: unknown refusal {other:?} in the table"),
                    };
                    assert!(kind_agrees, "{input:?}: {got:?}");
                    let message = got.map_err(|e| e.to_string()).unwrap_err();
                    assert!(message.contains(why), "{input:?}: {message}");
                }
            }
        }
    }
}
