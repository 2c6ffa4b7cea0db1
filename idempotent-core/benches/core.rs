//! Criterion benches of the core: key parsing, fingerprinting, and engine overhead on the
//! memory store (first execution = claim + complete; replay = one claim).

use criterion::{Criterion, criterion_group, criterion_main};
use idempotent_core::{engine::*, fingerprint::*, store::*, *};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn json_1k() -> Vec<u8> {
    let mut fields = Vec::new();
    let mut i = 0;
    while fields.iter().map(|f: &String| f.len() + 1).sum::<usize>() < 1000 {
        fields.push(format!(
            r#""field_{i:03}":{{"amount":{},"label":"item number {i}"}}"#,
            i * 37
        ));
        i += 1;
    }
    format!("{{{}}}", fields.join(",")).into_bytes()
}

/// The same members as [`json_1k`] in descending order, so every object is rewritten.
fn json_1k_unsorted() -> Vec<u8> {
    let mut fields = Vec::new();
    let mut i = 0;
    while fields.iter().map(|f: &String| f.len() + 1).sum::<usize>() < 1000 {
        fields.push(format!(
            r#""field_{i:03}":{{"label":"item number {i}","amount":{}}}"#,
            i * 37
        ));
        i += 1;
    }
    fields.reverse();
    format!("{{{}}}", fields.join(",")).into_bytes()
}

/// The same members as [`json_1k_unsorted`] in a scattered order (every seventh, from each
/// start in turn), as a serializer's field order is: neither sorted nor reversed.
fn json_1k_scattered() -> Vec<u8> {
    let text = String::from_utf8(json_1k_unsorted()).expect("utf-8");
    let inner = &text[1..text.len() - 1];
    let members: Vec<&str> = inner.split("},").collect();
    let n = members.len();
    let mut order = Vec::new();
    for start in 0..7 {
        order.extend((start..n).step_by(7));
    }
    let picked: Vec<String> = order
        .iter()
        .map(|&i| {
            let m = members[i];
            if m.ends_with('}') {
                m.to_string()
            } else {
                format!("{m}}}")
            }
        })
        .collect();
    format!("{{{}}}", picked.join(",")).into_bytes()
}

/// About 1 KiB of form fields, out of order, some with encoded bytes.
fn form_1k() -> Vec<u8> {
    let mut out = String::new();
    let mut i = 0;
    while out.len() < 1000 {
        if i > 0 {
            out.push('&');
        }
        out.push_str(&format!("field_{:02}=value+number+{i}%21&", 40 - i));
        out.push_str(&format!("meta[{i}]=x{i}"));
        i += 1;
    }
    out.into_bytes()
}

/// About `size` bytes of a checkout-like form in no order: fields of 10 to 30 bytes, names
/// that share prefixes (`customer%5Baddress%5D%5B…`), repeated names, escapes.
fn form_realistic(size: usize) -> Vec<u8> {
    const NAMES: [&str; 10] = [
        "customer%5Baddress%5D%5Bline1%5D",
        "customer%5Baddress%5D%5Bcity%5D",
        "items%5B%5D%5Bprice%5D",
        "items%5B%5D%5Bquantity%5D",
        "metadata%5Border_",
        "amount",
        "currency",
        "email",
        "first+name",
        "utm_source",
    ];
    const VALUES: [&str; 6] = [
        "value",
        "hello+world",
        "4200",
        "a%40b.com",
        "caf%C3%A9",
        "x",
    ];
    let mut state = 0x9e37_79b9_u32;
    let mut next = |n: usize| {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (state >> 8) as usize % n
    };
    let mut fields = Vec::new();
    let mut len = 0;
    while len < size {
        let field = format!(
            "{}{}={}",
            NAMES[next(NAMES.len())],
            next(40),
            VALUES[next(VALUES.len())]
        );
        len += field.len() + 1;
        fields.push(field);
    }
    fields.join("&").into_bytes()
}

/// The fingerprint of a `POST /v1/charges` with this body.
fn fingerprint_of(content_type: &str, body: &[u8]) -> Fingerprint {
    Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: Some(content_type),
        body: black_box(body),
    })
}

fn fp() -> Fingerprint {
    Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: Some("application/json"),
        body: br#"{"amount":500}"#,
    })
}

fn request(i: u64) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new("acct_bench").expect("scope"),
        key: IdempotencyKey::parse(format!("key-{i:016}").as_bytes()),
        fingerprint: fp(),
    }
}

fn response() -> StoredResponse {
    StoredResponse::new(201, &br#"{"id":"ch_123","amount":500}"#[..])
        .with_header("content-type", "application/json")
}

/// One request through the engine's entry, as the adapters drive it: claim, run the work
/// under the execution, store its outcome (`Ok`); any other answer, a replay included, is
/// returned as it came (`Err`).
async fn once(engine: &Engine, req: ExecuteRequest, policy: &Policy) -> Result<Recorded, Begin> {
    match engine.begin(req, policy).await {
        Begin::Claimed(mut execution) => {
            let outcome = execution.run(async { response() }).await.expect("no panic");
            Ok(execution.finish(outcome.into()).await)
        }
        other => Err(other),
    }
}

fn benches(c: &mut Criterion) {
    c.bench_function("key_parse/bare_uuid", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")))
    });
    c.bench_function("key_parse/sf_string", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)))
    });
    let body = json_1k();
    assert!((1000..1200).contains(&body.len()), "{}", body.len());
    let unsorted = json_1k_unsorted();
    let scattered = json_1k_scattered();
    assert_eq!(
        canonical_json(&scattered).expect("json"),
        canonical_json(&unsorted).expect("json")
    );
    for (name, json) in [
        ("fingerprint/json_1KiB", &body),
        ("fingerprint/json_1KiB_unsorted", &unsorted),
        ("fingerprint/json_1KiB_scattered", &scattered),
    ] {
        c.bench_function(name, |b| {
            b.iter(|| fingerprint_of("application/json", json))
        });
    }
    let form = form_1k();
    assert!((1000..1200).contains(&form.len()), "{}", form.len());
    c.bench_function("canonical_json/1KiB", |b| {
        b.iter(|| canonical_json(black_box(&body)))
    });
    c.bench_function("canonical_json/1KiB_unsorted", |b| {
        b.iter(|| canonical_json(black_box(&unsorted)))
    });
    c.bench_function("canonical_json/1KiB_scattered", |b| {
        b.iter(|| canonical_json(black_box(&scattered)))
    });
    c.bench_function("canonical_json/serde_jcs_1KiB", |b| {
        b.iter(|| {
            let value: serde_json::Value = serde_json::from_slice(black_box(&body)).expect("json");
            serde_jcs::to_vec(&value).expect("jcs")
        })
    });
    c.bench_function("canonical_form/1KiB", |b| {
        b.iter(|| canonical_form(black_box(&form)))
    });
    c.bench_function("fingerprint/form_1KiB", |b| {
        b.iter(|| fingerprint_of("application/x-www-form-urlencoded", &form))
    });
    for (name, kib) in [
        ("fingerprint/form_64KiB_realistic", 64),
        ("fingerprint/form_256KiB_realistic", 256),
    ] {
        let form = form_realistic(kib << 10);
        c.bench_function(name, |b| {
            b.iter(|| fingerprint_of("application/x-www-form-urlencoded", &form))
        });
    }
    c.bench_function("fingerprint/raw_1KiB", |b| {
        b.iter(|| fingerprint_of("application/octet-stream", &body))
    });

    // A handler's downstream key: the context (HMAC over scope and key) and one derivation.
    let secret = DeriveSecret::new([7u8; 32]).expect("secret");
    let scope = Scope::new("acct_1234567890").expect("scope");
    let key = IdempotencyKey::parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").expect("key");
    c.bench_function("derive/context_and_one_key", |b| {
        b.iter(|| {
            Idempotent::keyed(black_box(&secret), black_box(&scope), black_box(&key))
                .derive("payment-provider")
        })
    });

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let policy = Policy::default();

    // With and without a replay cache (issue 53): what a cache adds to a first execution (a
    // look that misses, then a copy kept after the complete).
    for (name, cache) in [
        ("engine_memory/first_execution", None),
        (
            "engine_memory/first_execution_replay_cache",
            Some(ReplayCache::new()),
        ),
    ] {
        c.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let store = MemoryStore::builder()
                    // One scope, as many records as the bench takes: no bound may refuse one.
                    .max_entries(usize::MAX)
                    .max_per_scope(usize::MAX)
                    .max_bytes(u64::MAX)
                    .max_bytes_per_scope(u64::MAX)
                    .build();
                let mut engine = Engine::builder(store);
                if let Some(cache) = cache {
                    engine = engine.replay_cache(cache);
                }
                let engine = engine.build().expect("engine");
                let requests: Vec<_> = (0..iters).map(request).collect();
                rt.block_on(async {
                    let start = Instant::now();
                    for req in requests {
                        let out = once(&engine, req, &policy).await;
                        debug_assert!(matches!(out, Ok(Recorded::Stored)));
                        let _ = black_box(out);
                    }
                    start.elapsed()
                })
            })
        });
    }

    for (name, cache) in [
        ("engine_memory/replay", None),
        (
            "engine_memory/replay_from_replay_cache",
            Some(ReplayCache::new()),
        ),
    ] {
        c.bench_function(name, |b| {
            let mut engine = Engine::builder(MemoryStore::new());
            if let Some(cache) = cache {
                engine = engine.replay_cache(cache);
            }
            let engine = engine.build().expect("engine");
            let seeded = rt.block_on(once(&engine, request(0), &policy));
            assert!(
                matches!(seeded, Ok(Recorded::Stored)),
                "the replayed record is stored"
            );
            b.iter_custom(|iters| {
                let requests: Vec<_> = (0..iters).map(|_| request(0)).collect();
                rt.block_on(async {
                    let start = Instant::now();
                    for req in requests {
                        let out = once(&engine, req, &policy).await;
                        debug_assert!(matches!(out, Err(Begin::Replay(_))));
                        let _ = black_box(out);
                    }
                    start.elapsed()
                })
            })
        });
    }
}

criterion_group! {
    name = core;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(core);
