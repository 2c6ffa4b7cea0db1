//! Request bodies decoded by their `Content-Encoding` for the fingerprint, with a hard bound on
//! the decoded size.
//!
//! The decoders and the way they are driven are actix-web's own (actix-http's `Decoder`: the
//! `write` decoders of `flate2`, `brotli` and `zstd`, fed the body and then finished the same
//! way), so a body decodes to exactly what actix-web's extractors read. What differs is where
//! the output goes: into a buffer that refuses to grow past the limit, so a small body that
//! expands enormously (a "zip bomb") stops at the limit instead of being decoded whole first.

use std::io::{self, Write};

/// Why a body could not be decoded.
#[derive(Debug)]
pub(crate) enum DecodeError {
    /// It decodes to more than the limit.
    TooLarge,
    /// It is not valid in its declared encoding.
    Invalid,
}

/// The encodings actix-web decodes (its `ContentEncoding`, parsed as it parses it: one token,
/// trimmed, any case). Anything else, a list of several codings included, is left as it is,
/// as actix-web leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    #[cfg(feature = "compress-brotli")]
    Brotli,
    #[cfg(feature = "compress-gzip")]
    Gzip,
    #[cfg(feature = "compress-gzip")]
    Deflate,
    #[cfg(feature = "compress-zstd")]
    Zstd,
}

impl Encoding {
    /// The encoding a `Content-Encoding` value names, if this build decodes it.
    pub(crate) fn parse(value: &[u8]) -> Option<Self> {
        let value = std::str::from_utf8(value).ok()?.trim();
        let is = |name: &str| value.eq_ignore_ascii_case(name);
        #[cfg(feature = "compress-brotli")]
        if is("br") {
            return Some(Encoding::Brotli);
        }
        #[cfg(feature = "compress-gzip")]
        if is("gzip") {
            return Some(Encoding::Gzip);
        }
        #[cfg(feature = "compress-gzip")]
        if is("deflate") {
            return Some(Encoding::Deflate);
        }
        #[cfg(feature = "compress-zstd")]
        if is("zstd") {
            return Some(Encoding::Zstd);
        }
        None
    }
}

/// A buffer that takes at most `limit` bytes; a write past that fails (and sets `over`).
#[derive(Default)]
struct Bounded {
    out: Vec<u8>,
    limit: usize,
    over: bool,
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            self.over = true;
            return Err(io::Error::other("decoded body over the limit"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `raw` decoded from `encoding`, at most `limit` bytes of it. CPU-bound: call it off the
/// async workers.
pub(crate) fn decode(encoding: Encoding, raw: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    let sink = Bounded {
        out: Vec::new(),
        limit,
        over: false,
    };
    match encoding {
        #[cfg(feature = "compress-brotli")]
        Encoding::Brotli => {
            // actix-http's buffer size for its brotli decoder.
            let mut d = brotli::DecompressorWriter::new(sink, 8_096);
            let done = d.write_all(raw).and_then(|()| d.flush());
            finish(done, d.into_inner().unwrap_or_else(|sink| sink))
        }
        #[cfg(feature = "compress-gzip")]
        Encoding::Gzip => {
            let mut d = flate2::write::GzDecoder::new(sink);
            let done = d.write_all(raw).and_then(|()| d.try_finish());
            finish(done, std::mem::take(d.get_mut()))
        }
        #[cfg(feature = "compress-gzip")]
        Encoding::Deflate => {
            let mut d = flate2::write::ZlibDecoder::new(sink);
            let done = d.write_all(raw).and_then(|()| d.try_finish());
            finish(done, std::mem::take(d.get_mut()))
        }
        #[cfg(feature = "compress-zstd")]
        Encoding::Zstd => match zstd::stream::write::Decoder::new(sink) {
            Ok(mut d) => {
                let done = d.write_all(raw).and_then(|()| d.flush());
                finish(done, d.into_inner())
            }
            Err(_) => Err(DecodeError::Invalid),
        },
    }
}

fn finish(done: io::Result<()>, sink: Bounded) -> Result<Vec<u8>, DecodeError> {
    match done {
        _ if sink.over => Err(DecodeError::TooLarge),
        Ok(()) => Ok(sink.out),
        Err(_) => Err(DecodeError::Invalid),
    }
}

#[cfg(all(
    test,
    feature = "compress-gzip",
    feature = "compress-brotli",
    feature = "compress-zstd"
))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn parses_as_actix_does() {
        assert_eq!(Encoding::parse(b" GZip "), Some(Encoding::Gzip));
        assert_eq!(Encoding::parse(b"br"), Some(Encoding::Brotli));
        assert_eq!(Encoding::parse(b"zstd"), Some(Encoding::Zstd));
        assert_eq!(Encoding::parse(b"deflate"), Some(Encoding::Deflate));
        for other in [&b"identity"[..], b"gzip, br", b"compress", b"", b"\xff"] {
            assert_eq!(Encoding::parse(other), None);
        }
    }

    #[test]
    fn round_trips_and_refuses_bad_input() {
        let text = b"{\"amount\": 40}".repeat(100);
        assert_eq!(decode(Encoding::Gzip, &gzip(&text), 1 << 20).unwrap(), text);
        let zst = zstd::encode_all(&text[..], 3).unwrap();
        assert_eq!(decode(Encoding::Zstd, &zst, 1 << 20).unwrap(), text);
        let mut br = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut br, 4096, 5, 22);
            w.write_all(&text).unwrap();
        }
        assert_eq!(decode(Encoding::Brotli, &br, 1 << 20).unwrap(), text);
        for enc in [
            Encoding::Gzip,
            Encoding::Deflate,
            Encoding::Brotli,
            Encoding::Zstd,
        ] {
            assert!(
                matches!(
                    decode(enc, b"not compressed", 1 << 20),
                    Err(DecodeError::Invalid)
                ),
                "{enc:?}"
            );
        }
    }

    /// A small body that decodes to far more than the limit stops at the limit: the output
    /// never holds more than the limit.
    #[test]
    fn bombs_stop_at_the_limit() {
        let zeros = vec![0_u8; 64 << 20];
        let limit = 2 << 20;
        let zst = zstd::encode_all(&zeros[..], 19).unwrap();
        assert!(zst.len() < 64 << 10);
        assert!(matches!(
            decode(Encoding::Zstd, &zst, limit),
            Err(DecodeError::TooLarge)
        ));
        assert!(matches!(
            decode(Encoding::Gzip, &gzip(&zeros), limit),
            Err(DecodeError::TooLarge)
        ));
        // Just at the limit still decodes.
        let exact = vec![7_u8; limit];
        assert_eq!(
            decode(Encoding::Gzip, &gzip(&exact), limit).unwrap().len(),
            limit
        );
    }
}
