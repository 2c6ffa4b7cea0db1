//! The shape of the workspace, checked: the names each published crate exports at its root
//! and in each public module (so a new export is a visible diff in `tests/public-api/`), the
//! paths `ARCHITECTURE.md` names (so the map cannot point at a file that moved) and the files
//! it must name, and the crates' `use crate::…` edges (no circle, nothing through a root).
//!
//! After an intended change to the public names: `PUBLIC_API=overwrite cargo test --test
//! layout`, then review the diff of `tests/public-api/`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use syn::{Item, UseTree, Visibility};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace")
        .to_owned()
}

/// Whether the item carries `#[doc(hidden)]`.
fn hidden(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("doc") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "hidden")
    })
}

/// The item's `#[cfg(…)]`, as written, or "".
fn cfg(attrs: &[syn::Attribute]) -> String {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .map(|a| {
            let syn::Meta::List(list) = &a.meta else {
                return String::new();
            };
            format!(" #[cfg({})]", list.tokens).replace(" ,", ",")
        })
        .collect()
}

fn use_names(tree: &UseTree, parent: Option<String>, out: &mut Vec<String>) {
    match tree {
        UseTree::Path(p) => use_names(&p.tree, Some(p.ident.to_string()), out),
        UseTree::Name(n) if n.ident == "self" => out.extend(parent),
        UseTree::Name(n) => out.push(n.ident.to_string()),
        UseTree::Rename(r) => out.push(r.rename.to_string()),
        UseTree::Glob(_) => out.push(format!("{}::*", parent.unwrap_or_default())),
        UseTree::Group(g) => {
            for t in &g.items {
                use_names(t, parent.clone(), out);
            }
        }
    }
}

/// One line per public name at the crate's root: `kind name [cfg] [hidden]`, sorted.
fn root_names(lib: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    item_names(&file.items)
}

/// The items of core's `__private::exports` module (`idempotent-core/src/adapter.rs`), which
/// each adapter re-exports at its root with a glob.
fn adapter_exports() -> Vec<syn::Item> {
    let path = workspace().join("idempotent-core/src/adapter.rs");
    let text = std::fs::read_to_string(&path).expect("adapter.rs");
    let file = syn::parse_file(&text).expect("adapter.rs parses");
    file.items
        .into_iter()
        .find_map(|item| match item {
            Item::Mod(m) if m.ident == "exports" => m.content.map(|(_, items)| items),
            _ => None,
        })
        .expect("adapter.rs has `pub mod exports { … }`")
}

/// [`root_names`] of a file's items: `kind name [cfg] [hidden]`, sorted; the adapters' glob
/// of core's `exports` is listed name by name.
fn item_names(items: &[syn::Item]) -> Vec<String> {
    let mut lines = BTreeSet::new();
    for item in items {
        if let Item::Use(u) = item {
            let mut names = Vec::new();
            use_names(&u.tree, None, &mut names);
            if names == ["exports::*"] {
                lines.extend(item_names(&adapter_exports()));
                continue;
            }
        }
        let (vis, attrs, kind, names): (&Visibility, &[syn::Attribute], &str, Vec<String>) =
            match item {
                Item::Use(u) => {
                    let mut names = Vec::new();
                    use_names(&u.tree, None, &mut names);
                    (&u.vis, &u.attrs, "use", names)
                }
                Item::Mod(m) => (&m.vis, &m.attrs, "mod", vec![m.ident.to_string()]),
                Item::Fn(f) => (&f.vis, &f.attrs, "fn", vec![f.sig.ident.to_string()]),
                Item::Struct(s) => (&s.vis, &s.attrs, "struct", vec![s.ident.to_string()]),
                Item::Enum(e) => (&e.vis, &e.attrs, "enum", vec![e.ident.to_string()]),
                Item::Trait(t) => (&t.vis, &t.attrs, "trait", vec![t.ident.to_string()]),
                Item::Type(t) => (&t.vis, &t.attrs, "type", vec![t.ident.to_string()]),
                Item::Const(c) => (&c.vis, &c.attrs, "const", vec![c.ident.to_string()]),
                Item::Static(s) => (&s.vis, &s.attrs, "static", vec![s.ident.to_string()]),
                Item::Macro(m) if m.attrs.iter().any(|a| a.path().is_ident("macro_export")) => {
                    let name = m
                        .ident
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    lines.insert(format!("macro {name}"));
                    continue;
                }
                _ => continue,
            };
        if !matches!(vis, Visibility::Public(_)) {
            continue;
        }
        let suffix = format!(
            "{}{}",
            cfg(attrs),
            if hidden(attrs) { " (hidden)" } else { "" }
        );
        for name in names {
            lines.insert(format!("{kind} {name}{suffix}"));
        }
    }
    lines.into_iter().collect()
}

/// The public surface of a crate one module deep and further (issue 50, item 4): the root's
/// names as [`item_names`] lists them, then, for each public module that is not hidden, its
/// own names prefixed with its path (`engine: struct Policy`), its public modules likewise.
/// A name added to `idempotent_core::engine` is a diff in the golden file, as one added at the
/// root is.
fn public_names(src: &Path) -> Vec<String> {
    let lib = src.join("lib.rs");
    let text = std::fs::read_to_string(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let mut lines = item_names(&file.items);
    module_names(&file.items, src, "", &mut lines);
    lines
}

/// The names of `items`' public, not hidden modules (files under `dir`, or inline), each line
/// prefixed with the module's path from the root.
fn module_names(items: &[Item], dir: &Path, prefix: &str, out: &mut Vec<String>) {
    for item in items {
        let Item::Mod(m) = item else { continue };
        if !matches!(m.vis, Visibility::Public(_)) || hidden(&m.attrs) {
            continue;
        }
        let name = m.ident.to_string();
        let path = format!("{prefix}{name}");
        let (items, child_dir) = match &m.content {
            Some((_, items)) => (items.clone(), dir.join(&name)),
            None => {
                let file = [
                    dir.join(format!("{name}.rs")),
                    dir.join(&name).join("mod.rs"),
                ]
                .into_iter()
                .find(|f| f.exists())
                .unwrap_or_else(|| panic!("module {path}: no file under {}", dir.display()));
                let text = std::fs::read_to_string(&file).expect("module source");
                let parsed =
                    syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                (parsed.items, dir.join(&name))
            }
        };
        out.extend(
            item_names(&items)
                .into_iter()
                .map(|line| format!("{path}: {line}")),
        );
        module_names(&items, &child_dir, &format!("{path}::"), out);
    }
}

const PUBLISHED: [&str; 5] = [
    "idempotent-core",
    "idempotent-macros",
    "idempotent-axum",
    "idempotent-actix",
    "idempotent-client",
];

#[test]
fn public_names_are_as_recorded() {
    let root = workspace();
    let overwrite = std::env::var_os("PUBLIC_API").is_some_and(|v| v == "overwrite");
    let mut differ = Vec::new();
    for krate in PUBLISHED {
        let names = public_names(&root.join(krate).join("src"));
        assert!(!names.is_empty(), "{krate}: no public names read");
        if krate == "idempotent-core" {
            // Every public module is read, not only the root.
            for module in [
                "call",
                "clock",
                "engine",
                "fingerprint",
                "http",
                "observe",
                "store",
                "tx",
            ] {
                assert!(
                    names.iter().any(|l| l.starts_with(&format!("{module}: "))),
                    "no names read from idempotent_core::{module}"
                );
            }
        }
        let listing = names.join("\n") + "\n";
        let golden = root.join("tests/public-api").join(format!("{krate}.txt"));
        if overwrite {
            std::fs::write(&golden, &listing).expect("write the listing");
            continue;
        }
        let recorded = std::fs::read_to_string(&golden).unwrap_or_default();
        if recorded != listing {
            differ.push(format!(
                "{krate}: its public names changed; if intended, run with PUBLIC_API=overwrite and review the diff\n--- recorded\n{recorded}--- now\n{listing}"
            ));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

#[test]
fn the_core_root_holds_only_what_users_name() {
    let names = root_names(&workspace().join("idempotent-core/src/lib.rs"));
    let visible: Vec<_> = names.iter().filter(|l| !l.ends_with("(hidden)")).collect();
    assert!(
        visible.len() <= 35,
        "{} names at idempotent-core's root (at most 35): {visible:#?}",
        visible.len()
    );
    // What only the adapters use is not among them.
    for adapter_only in [
        "Route", "Capture", "Recorder", "Reply", "Step", "Detached", "Glue",
    ] {
        assert!(
            !visible
                .iter()
                .any(|l| l.split(' ').nth(1) == Some(adapter_only)),
            "{adapter_only} is exported at the root"
        );
    }
    assert!(
        names
            .iter()
            .any(|l| l.starts_with("mod __private") && l.ends_with("(hidden)")),
        "the adapters' module is hidden: {names:#?}"
    );
}

/// Every path `ARCHITECTURE.md` names (in backticks, with a `/`) exists.
#[test]
fn architecture_names_only_paths_that_exist() {
    let root = workspace();
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut checked = 0;
    let mut missing = Vec::new();
    for (i, span) in text.split('`').enumerate() {
        // Odd pieces are inside backticks.
        let looks_like_path = i % 2 == 1
            && span.contains('/')
            && !span.contains(' ')
            && !span.starts_with('/')
            && (span.ends_with('/') || Path::new(span).extension().is_some());
        if !looks_like_path {
            continue;
        }
        checked += 1;
        if !root.join(span).exists() {
            missing.push(span.to_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
    // The map names the concept files and the request's path: a parser that found few paths
    // would pass without checking anything.
    assert!(
        checked >= 30,
        "only {checked} paths found in ARCHITECTURE.md"
    );
    for concept in [
        "engine/claim.rs",
        "engine/lease.rs",
        "store/fence.rs",
        "fingerprint.rs",
        "http/reply.rs",
        "tx/commit.rs",
        "call/mod.rs",
        "adapter.rs",
    ] {
        assert!(
            text.contains(&format!("`idempotent-core/src/{concept}`")),
            "ARCHITECTURE.md does not map {concept}"
        );
    }
}

/// Every `.rs` file under `dir`, relative to it, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(dir).expect("under dir").to_owned());
            }
        }
    }
    out.sort();
    out
}

/// The paths a `use` tree names, each as its segments (`crate::store::Store` → `["crate",
/// "store", "Store"]`).
fn use_paths(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        UseTree::Name(n) => {
            let mut path = prefix.clone();
            if n.ident != "self" {
                path.push(n.ident.to_string());
            }
            out.push(path);
        }
        UseTree::Rename(r) => {
            let mut path = prefix.clone();
            path.push(r.ident.to_string());
            out.push(path);
        }
        UseTree::Glob(_) => out.push(prefix.clone()),
        UseTree::Group(g) => {
            for t in &g.items {
                use_paths(t, prefix, out);
            }
        }
    }
}

/// The `use crate::…` paths of a file's items, nested modules' included.
fn crate_uses(items: &[Item], out: &mut Vec<Vec<String>>) {
    for item in items {
        match item {
            Item::Use(u) => {
                let mut paths = Vec::new();
                use_paths(&u.tree, &mut Vec::new(), &mut paths);
                out.extend(
                    paths
                        .into_iter()
                        .filter(|p| p.first().is_some_and(|s| s == "crate")),
                );
            }
            Item::Mod(m) => {
                if let Some((_, items)) = &m.content {
                    crate_uses(items, out);
                }
            }
            Item::Fn(f) => {
                for stmt in &f.block.stmts {
                    if let syn::Stmt::Item(item) = stmt {
                        crate_uses(std::slice::from_ref(item), out);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The `crate::…` paths a file's code names outside `use` items (`crate::http::X` in an
/// expression, a type, an attribute), found in its tokens: comments and doc comments are not
/// tokens here, so a doc link is no edge; `$crate::…` (a macro's path to its own crate's root)
/// is not counted.
fn inline_crate_paths(text: &str) -> Vec<Vec<String>> {
    fn walk(stream: proc_macro2::TokenStream, out: &mut Vec<Vec<String>>) {
        use proc_macro2::TokenTree;
        let tokens: Vec<TokenTree> = stream.into_iter().collect();
        let is_colons = |i: usize| {
            matches!((tokens.get(i), tokens.get(i + 1)),
                (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                    if a.as_char() == ':' && b.as_char() == ':')
        };
        for (i, token) in tokens.iter().enumerate() {
            match token {
                TokenTree::Group(g) => walk(g.stream(), out),
                TokenTree::Ident(id) if id == "crate" => {
                    let after_dollar = i > 0
                        && matches!(&tokens[i - 1], TokenTree::Punct(p) if p.as_char() == '$');
                    if after_dollar {
                        continue;
                    }
                    let mut path = vec!["crate".to_owned()];
                    let mut j = i + 1;
                    while is_colons(j) {
                        match tokens.get(j + 2) {
                            Some(TokenTree::Ident(seg)) => path.push(seg.to_string()),
                            _ => break,
                        }
                        j += 3;
                    }
                    if path.len() > 1 {
                        out.push(path);
                    }
                }
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(text.parse().expect("source tokenises"), &mut out);
    out
}

/// The file of `src` that module path `segments` (after `crate`) is defined in: the longest
/// prefix of it that names a file (`a/b.rs` or `a/b/mod.rs`); `lib.rs` for the root.
fn module_file(src: &Path, segments: &[String]) -> PathBuf {
    for n in (1..=segments.len()).rev() {
        let dir: PathBuf = segments[..n].iter().collect();
        let file = dir.with_extension("rs");
        if src.join(&file).exists() {
            return file;
        }
        if src.join(dir.join("mod.rs")).exists() {
            return dir.join("mod.rs");
        }
    }
    PathBuf::from("lib.rs")
}

/// The `use crate::…` edges of each published crate, checked (issue 50, item 1): no two files
/// import from each other (a circle), and no module imports through its crate root (`use
/// crate::SqliteStore` where `crate::store::…` is where it lives): the root is what a user
/// names, not a shortcut inside the crate. What a file imports from its own ancestors or
/// descendants is its module's business and not an edge here.
fn import_problems(krate: &str) -> Vec<String> {
    import_problems_in(krate, &workspace().join(krate).join("src"))
}

fn import_problems_in(krate: &str, src: &Path) -> Vec<String> {
    let lib_text = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let lib = syn::parse_file(&lib_text).expect("lib.rs parses");
    // What the root defines itself (modules and items), as opposed to what it re-exports.
    let defined: BTreeSet<String> = lib
        .items
        .iter()
        .filter_map(|item| match item {
            Item::Mod(m) => Some(m.ident.to_string()),
            Item::Fn(f) => Some(f.sig.ident.to_string()),
            Item::Struct(s) => Some(s.ident.to_string()),
            Item::Enum(e) => Some(e.ident.to_string()),
            Item::Trait(t) => Some(t.ident.to_string()),
            Item::Type(t) => Some(t.ident.to_string()),
            Item::Const(c) => Some(c.ident.to_string()),
            Item::Static(s) => Some(s.ident.to_string()),
            Item::Macro(m) => m.ident.as_ref().map(ToString::to_string),
            _ => None,
        })
        .collect();
    let mut problems = Vec::new();
    let mut edges: BTreeSet<(PathBuf, PathBuf)> = BTreeSet::new();
    for file in rust_files(src) {
        let text = std::fs::read_to_string(src.join(&file)).expect("source");
        let parsed = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{krate}/src/{}: {e}", file.display()));
        let mut paths = Vec::new();
        crate_uses(&parsed.items, &mut paths);
        paths.extend(inline_crate_paths(&text));
        for path in paths {
            let segments = &path[1..];
            let Some(first) = segments.first() else {
                continue;
            };
            if file != Path::new("lib.rs") && !defined.contains(first) {
                problems.push(format!(
                    "{krate}/src/{} imports `crate::{}` through the crate root: name the module it lives in",
                    file.display(),
                    segments.join("::")
                ));
                continue;
            }
            let target = module_file(src, segments);
            let own_dir = |f: &Path| {
                let parent = f.parent().map(Path::to_owned).unwrap_or_default();
                if f.file_name()
                    .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
                {
                    parent
                } else {
                    parent.join(f.file_stem().expect("stem"))
                }
            };
            // Ancestors and descendants of each other: one module's own business.
            let (a, b) = (own_dir(&file), own_dir(&target));
            if target == file || a.starts_with(&b) || b.starts_with(&a) {
                continue;
            }
            edges.insert((file.clone(), target));
        }
    }
    for (a, b) in &edges {
        if a < b && edges.contains(&(b.clone(), a.clone())) {
            problems.push(format!(
                "{krate}/src/{} and {krate}/src/{} import from each other (a circle): move what both need where one of them, or a third file, owns it",
                a.display(),
                b.display()
            ));
        }
    }
    problems
}

#[test]
fn no_circles_and_no_imports_through_the_crate_root() {
    let mut problems = Vec::new();
    for krate in PUBLISHED {
        problems.extend(import_problems(krate));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // The check itself can fail: a crate whose two modules name each other (one by a `use`,
    // one by a path in code) and which imports through its root.
    let dir = tempfile::tempdir().expect("temp dir");
    let files = [
        ("lib.rs", "mod a;\nmod b;\npub use a::A;\n"),
        ("a.rs", "use crate::b::B;\npub struct A(B);\n"),
        (
            "b.rs",
            "pub struct B;\nfn f() -> usize { crate::a::N + std::mem::size_of::<crate::A>() }\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("write");
    }
    let found = import_problems_in("demo", dir.path());
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].contains("`crate::A` through the crate root"),
        "{found:?}"
    );
    assert!(found[1].contains("import from each other"), "{found:?}");
}

/// The source files a map leaves out (issue 50, item 2): every `.rs` file under `src/` of
/// each published crate and of the admin tool (`<crate>/src/<path>`), and every conformance
/// suite (`tests/tests/*_conformance.rs`, named by its `tests/<name>` path in the tests' own
/// map), must appear in backticks in its map. A file added without a word about where it fits
/// fails here.
fn unmapped(architecture: &str, tests_readme: &str) -> Vec<String> {
    let root = workspace();
    let mut missing = Vec::new();
    for krate in PUBLISHED.iter().copied().chain(["idempotent-admin"]) {
        for file in rust_files(&root.join(krate).join("src")) {
            let path = format!("{krate}/src/{}", file.display());
            if !architecture.contains(&format!("`{path}`")) {
                missing.push(format!("ARCHITECTURE.md does not name `{path}`"));
            }
        }
    }
    for file in rust_files(&root.join("tests/tests")) {
        let name = file.display().to_string();
        if name.ends_with("_conformance.rs") && !tests_readme.contains(&format!("`tests/{name}`")) {
            missing.push(format!("tests/README.md does not list `tests/{name}`"));
        }
    }
    missing
}

#[test]
fn every_source_file_and_conformance_suite_is_on_a_map() {
    let root = workspace();
    let architecture =
        std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let tests_readme =
        std::fs::read_to_string(root.join("tests/README.md")).expect("tests/README.md");
    let missing = unmapped(&architecture, &tests_readme);
    assert!(missing.is_empty(), "{}", missing.join("\n"));
    // The check can fail: the same maps without one file's name, and without one suite's.
    let without = architecture.replace("`idempotent-core/src/jcs.rs`", "");
    assert_eq!(
        unmapped(&without, &tests_readme),
        ["ARCHITECTURE.md does not name `idempotent-core/src/jcs.rs`"]
    );
    let without = tests_readme.replace("`tests/redis_conformance.rs`", "");
    assert_eq!(
        unmapped(&architecture, &without),
        ["tests/README.md does not list `tests/redis_conformance.rs`"]
    );
}

/// Whether `text` names the design file kept outside the repository, in any spelling a
/// citation takes (`….md §3`, `` `….md` section 3 ``, `….md#anchor`, `… §3`).
fn cites_outside(text: &str) -> bool {
    // Spelled in pieces, so this file does not name it either.
    let name = ["DESIGN", ".md"].concat();
    let section = ["DESIGN", " §"].concat();
    text.contains(&name) || text.contains(&section)
}

/// The code and the documents cite only documents in the repository (issue 50, item 2): a
/// reference to a design file that is not here sends a reader nowhere.
#[test]
fn citations_stay_inside_the_repository() {
    let root = workspace();
    let mut files = Vec::new();
    for dir in [
        "idempotent-core",
        "idempotent-macros",
        "idempotent-axum",
        "idempotent-actix",
        "idempotent-client",
        "idempotent-admin",
        "examples",
        "tests",
        "docs",
    ] {
        let mut todo = vec![root.join(dir)];
        while let Some(d) = todo.pop() {
            for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    todo.push(path);
                } else if path
                    .extension()
                    .is_some_and(|e| e == "rs" || e == "md" || e == "txt")
                {
                    files.push(path);
                }
            }
        }
    }
    for doc in [
        "README.md",
        "ARCHITECTURE.md",
        "SECURITY.md",
        "CHANGELOG.md",
        "BENCHMARKS.md",
    ] {
        files.push(root.join(doc));
    }
    assert!(files.len() > 100, "only {} files read", files.len());
    // The check can fail, on each spelling.
    for cited in ["see X.md §3", "`X.md` section 3", "X.md#leases", "X §4"] {
        assert!(
            cites_outside(&cited.replace('X', &["DES", "IGN"].concat())),
            "{cited}"
        );
    }
    assert!(!cites_outside("docs/semantics.md §3"));
    let cites: Vec<String> = files
        .iter()
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|t| cites_outside(&t)))
        .map(|f| f.strip_prefix(&root).unwrap_or(f).display().to_string())
        .collect();
    assert!(
        cites.is_empty(),
        "cite docs/semantics.md, ARCHITECTURE.md or SECURITY.md instead of the design file outside the repository: {cites:?}"
    );
}
