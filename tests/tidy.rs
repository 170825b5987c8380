//! House rules no linter checks: every module says what it is, what it owns and what it never
//! does, `unsafe` stays in `io`, `staging`,
//! the plugin artifact cache, the read pipeline's reads into a batch and checks of it on other
//! threads, and the Python bindings' DLPack export, and is justified where it
//! stands, no module uses one after it in `lib.rs`'s layer order, and no debugging leftovers
//! or stubs ship. The engine's sources are named relative to
//! `engine/src`, the bindings' as `python/...`.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn sources() -> Vec<(PathBuf, String)> {
    let engine = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for (src, prefix, at_least) in
        [(engine.join("src"), Path::new(""), 20), (engine.join("../python/src"), Path::new("python"), 4)]
    {
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        files.sort();
        assert!(files.len() >= at_least, "found the sources in {}", src.display());
        out.extend(files.into_iter().map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            (prefix.join(path.strip_prefix(&src).unwrap()), text)
        }));
    }
    out
}

#[test]
fn every_module_opens_with_a_doc_comment() {
    for (path, text) in sources() {
        assert!(text.starts_with("//!"), "{} does not open with a //! comment", path.display());
    }
}

#[test]
fn every_module_says_what_it_owns_and_what_it_never_does() {
    // The module header, rust-analyzer's way: what the file owns, and what it leaves to others
    // (a test module is its subject's). The engine's and the bindings' alike.
    let mut checked = 0;
    for (path, text) in sources() {
        if path.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let header: Vec<&str> = text.lines().take_while(|line| line.starts_with("//!")).collect();
        let header = header.join("\n");
        assert!(
            header.contains("Owns") && header.contains("Never"),
            "{}: its //! header does not say what it owns (`Owns`) and what it never does (`Never`)",
            path.display()
        );
        checked += 1;
    }
    assert!(checked >= 100, "checked the engine's sources ({checked})");
}

/// The most lines a source file may have before its tests; a file that grows past it is split
/// by job, as `mds/` and `coded/` were.
const LINES_MAX: usize = 800;

/// A function longer than this does not read in one screen: a few remain (the frame codec's
/// two directions, the CLI's bench and plugin commands, replication's `replicate`, the read
/// pipeline's `next_op`), listed by the report; no more may join them, and none may grow past
/// `FN_LINES_CEILING`.
const FN_LINES_LONG: usize = 120;
const FN_LONG_MAX: usize = 8;
const FN_LINES_CEILING: usize = 250;

/// `text` up to its unit tests.
fn before_tests(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod tests").map_or(text, |at| &text[..at])
}

#[test]
fn no_source_file_grows_past_the_line_bound() {
    let long: Vec<String> = sources()
        .into_iter()
        .filter(|(_, text)| before_tests(text).lines().count() > LINES_MAX)
        .map(|(path, text)| format!("{} ({} lines)", path.display(), before_tests(&text).lines().count()))
        .collect();
    assert!(long.is_empty(), "longer than {LINES_MAX} lines before the tests, split by job: {long:?}");
}

/// Each function of `text` (outside its tests): its name, first line and length in lines. The
/// braces of string and character literals are not counted.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<String> = before_tests(text).lines().map(without_literals).collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let Some(name) = code.split("fn ").nth(1).filter(|_| !code.starts_with("//") && is_fn_line(code)) else {
            continue;
        };
        let name: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let (mut depth, mut opened) = (0i64, false);
        for (j, body) in lines.iter().enumerate().skip(i) {
            for c in body.chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth == 0 {
                out.push((name.clone(), i + 1, j - i + 1));
                break;
            }
            if !opened && body.trim_end().ends_with(';') {
                break;
            }
        }
    }
    out
}

/// Whether `code` (a trimmed line) begins a function: `fn` after visibility and qualifiers only.
fn is_fn_line(code: &str) -> bool {
    let Some(at) = code.find("fn ") else { return false };
    code[..at].split_whitespace().all(|word| {
        matches!(word, "pub" | "async" | "const" | "unsafe" | "extern" | "\"\"") || word.starts_with("pub(")
    })
}

/// `line` with the contents of its string and character literals emptied.
fn without_literals(line: &str) -> String {
    let (mut out, mut chars) = (String::new(), line.chars().peekable());
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push('"');
                while let Some(inner) = chars.next() {
                    match inner {
                        '\\' => _ = chars.next(),
                        '"' => break,
                        _ => {}
                    }
                }
                out.push('"');
            }
            '\'' if matches!(chars.clone().nth(1), Some('\'')) => {
                chars.next();
                chars.next();
                out.push_str("' '");
            }
            other => out.push(other),
        }
    }
    out
}

/// The `.rs` names ARCHITECTURE.md puts in backticks.
fn named_in_architecture() -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../ARCHITECTURE.md"))
        .expect("ARCHITECTURE.md");
    text.split('`').skip(1).step_by(2).filter(|word| word.ends_with(".rs")).map(str::to_owned).collect()
}

#[test]
fn architecture_names_every_source_file_and_only_files_that_exist() {
    let named = named_in_architecture();
    let files: Vec<String> = sources().into_iter().map(|(path, _)| path.display().to_string()).collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut tree = Vec::new();
    for dir in ["engine/src", "python/src", "tests", "benches", "fuzz", "engine/examples"] {
        if root.join(dir).is_dir() {
            rust_files(&root.join(dir), &mut tree);
        }
    }
    let tree: Vec<String> =
        tree.iter().filter_map(|path| path.strip_prefix(&root).ok()).map(|p| p.display().to_string()).collect();
    for name in &named {
        let exists = root.join(name).is_file() || tree.iter().any(|f| f == name || f.ends_with(&format!("/{name}")));
        assert!(exists, "ARCHITECTURE.md names `{name}`, which is not in the tree");
    }
    for file in &files {
        let base = file.rsplit('/').next().unwrap_or(file);
        if matches!(base, "mod.rs" | "lib.rs" | "main.rs" | "tests.rs") {
            continue;
        }
        assert!(
            named.iter().any(|name| name == base || name == file || file.ends_with(&format!("/{name}"))),
            "{file} is not named in ARCHITECTURE.md: say what it owns where its module is described"
        );
    }
}

/// Assertions a 1,000 lines of the engine (outside unit tests) at least, and the places that
/// state invariants and must check one: issue 54's list and its floor of 3 (3.05 when it was
/// reached).
const ASSERTS_PER_1000_MIN: f64 = 3.0;
const ASSERTED_PLACES: [&str; 8] =
    ["loader/", "policy/", "origin/", "store/", "tier/", "plan.rs", "blend.rs", "pack.rs"];

/// `assert!`, `assert_eq!`, `assert_ne!` and their `debug_` forms in `text`.
fn assertions(text: &str) -> usize {
    ["assert!(", "assert_eq!(", "assert_ne!("].iter().map(|m| text.matches(m).count()).sum()
}

#[test]
fn invariants_are_asserted_where_they_live() {
    let (mut asserts, mut lines) = (0, 0);
    let mut places = [0usize; ASSERTED_PLACES.len()];
    for (path, text) in sources() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        // The bindings, and files of unit tests (`frame/tests.rs`, `batch_plan_tests.rs`).
        if path.starts_with("python") || name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let code = before_tests(&text);
        let n = assertions(code);
        asserts += n;
        lines += code.lines().count();
        let shown = path.display().to_string();
        for (place, count) in ASSERTED_PLACES.iter().zip(places.iter_mut()) {
            if shown.starts_with(place) {
                *count += n;
            }
        }
    }
    let density = asserts as f64 * 1000.0 / lines as f64;
    println!("assertions: {asserts} in {lines} lines, {density:.2} a 1,000");
    assert!(density >= ASSERTS_PER_1000_MIN, "{density:.2} assertions a 1,000 lines, under {ASSERTS_PER_1000_MIN}");
    for (place, count) in ASSERTED_PLACES.iter().zip(places) {
        assert!(count > 0, "no assertion in {place}: state its invariants where they live");
    }
}

#[test]
fn long_functions_are_few_and_reported() {
    let mut long = Vec::new();
    for (path, text) in sources() {
        for (name, line, length) in functions(&text) {
            assert!(
                length <= FN_LINES_CEILING,
                "{}:{line}: fn {name} is {length} lines, past {FN_LINES_CEILING}: split it into named steps",
                path.display()
            );
            if length > FN_LINES_LONG {
                long.push(format!("{}:{line} fn {name} ({length} lines)", path.display()));
            }
        }
    }
    // The report, in the test's output (`cargo test --test tidy -- --nocapture`).
    println!("functions over {FN_LINES_LONG} lines: {}", long.len());
    for entry in &long {
        println!("  {entry}");
    }
    assert!(long.len() <= FN_LONG_MAX, "more than {FN_LONG_MAX} functions over {FN_LINES_LONG} lines: {long:#?}");
}

#[test]
fn the_function_measure_reads_braces_in_literals_and_tests_out() {
    let text =
        "fn a() {\n    let s = \"}}\";\n    let c = '{';\n}\n#[cfg(test)]\nmod tests {\n    fn b() {\n    }\n}\n";
    assert_eq!(functions(text), vec![("a".to_owned(), 1, 4)]);
}

#[test]
fn unsafe_code_lives_in_io_and_staging_and_says_why() {
    for (path, text) in sources() {
        // Loading precompiled plugin code, DLPack's C structs and deleter, and the Arrow C
        // stream a PyCapsule holds (`python/arrow.rs`) are other places: none can be done safely. The read pipeline is the last: it hands ranges of
        // a batch's memory to the kernel (reads straight into the batch) and to verify workers,
        // and the promise that each range is one owner's until its op or check is done rests on
        // the pipeline's own bookkeeping (`read/pipeline.rs`, `read/batch.rs`, `read/batch_plan.rs`,
        // `read/verify.rs`).
        let allowed = path.starts_with("io")
            || path.starts_with("staging")
            || path == Path::new("policy/cache.rs")
            || path == Path::new("python/dlpack.rs")
            || path == Path::new("python/arrow.rs")
            || path == Path::new("read/pipeline.rs")
            || path == Path::new("read/batch.rs")
            || path == Path::new("read/batch_plan.rs")
            || path == Path::new("read/verify.rs");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let is_unsafe = ["unsafe {", "unsafe{", "unsafe impl", "unsafe fn"].iter().any(|u| code.contains(u));
            if !is_unsafe {
                continue;
            }
            assert!(allowed, "{}:{}: unsafe outside io/ and staging/", path.display(), i + 1);
            let above = &lines[i.saturating_sub(8)..=i];
            if code.contains("unsafe fn") {
                assert!(
                    above.iter().any(|l| l.contains("# Safety")),
                    "{}:{}: unsafe fn without a # Safety section",
                    path.display(),
                    i + 1
                );
            } else {
                assert!(
                    above.iter().any(|l| l.contains("SAFETY:")),
                    "{}:{}: unsafe without a SAFETY comment just above",
                    path.display(),
                    i + 1
                );
            }
        }
        if text.contains("allow(unsafe_code") {
            assert!(allowed, "{} opts into unsafe code outside io/ and staging/", path.display());
        }
    }
}

#[test]
fn no_debugging_leftovers_or_stubs() {
    for (path, text) in sources() {
        for (i, line) in text.lines().enumerate() {
            for banned in ["dbg!(", "todo!(", "unimplemented!(", "println!(\"DEBUG"] {
                assert!(!line.contains(banned), "{}:{}: {banned}", path.display(), i + 1);
            }
        }
    }
}

#[test]
fn the_command_line_prints_only_through_its_output_macros() {
    // `println!` and friends panic when stdout or stderr is full or closed; the command line
    // writes through `cli/output.rs` (`outln!`, `errln!`, ...), which return or drop the error.
    let mut n_cli = 0;
    for (path, text) in sources() {
        if !path.starts_with("cli") || path == Path::new("cli/output.rs") {
            continue;
        }
        n_cli += 1;
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for banned in ["println!(", "print!(", "eprintln!(", "eprint!("] {
                let found = code.match_indices(banned).any(|(at, _)| {
                    // `print!(` also matches inside `eprint!(` and `println!(`'s cousins.
                    !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_')
                });
                assert!(!found, "{}:{}: {banned} (use outln!/out!/errln!/err!)", path.display(), i + 1);
            }
        }
    }
    assert!(n_cli >= 5, "found the command line's sources");
}

/// The modules `lib.rs` declares, in its order (the layer order).
fn layer_order() -> Vec<String> {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let order: Vec<String> = lib
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub mod ")?.strip_suffix(';').map(str::to_owned))
        .collect();
    assert!(order.len() >= 15 && order[0] == "id", "read the module order from lib.rs: {order:?}");
    order
}

/// The top modules `code` names through `crate::`: `crate::x::...` and every name of a
/// `crate::{x, y::z, ...}` group, with the byte offset of each.
fn crate_paths(code: &str) -> Vec<(String, usize)> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `$crate::`, `some_crate::`
        }
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push((ident(rest), at));
            continue;
        };
        // The group's items at depth 0, each by its first name.
        let (mut depth, mut start) = (0usize, 0usize);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push((ident(group[start..i].trim()), at));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push((ident(group[start..i].trim()), at));
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    out.retain(|(name, _)| !name.is_empty());
    out
}

#[test]
fn no_module_uses_one_after_it_in_the_layer_order() {
    // `lib.rs`: a module uses only the modules before it, never one after it; the wings
    // (replication, origin) and the top floor (loader, cli) come last.
    let order = layer_order();
    let rank = |name: &str| order.iter().position(|m| m == name);
    let mut checked = 0;
    for (path, text) in sources() {
        if path.starts_with("python") {
            continue;
        }
        let top = path.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_owned();
        let Some(own) = rank(&top) else { continue };
        checked += 1;
        // Comments aside (a module's doc may name what comes after it).
        let code: String =
            text.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        for (name, at) in crate_paths(&code) {
            if let Some(theirs) = rank(&name) {
                assert!(
                    theirs <= own,
                    "{}:{}: `{top}` uses `crate::{name}`, which comes after it in lib.rs's layer order \
                     ({})",
                    path.display(),
                    code[..at].lines().count(),
                    order.join(" -> ")
                );
            }
        }
    }
    assert!(checked >= 100, "checked the engine's sources ({checked})");
}

#[test]
fn the_layer_check_reads_paths_and_groups() {
    let code = "use crate::store::{A, B};\nuse crate::{\n    io::{flock, X},\n    loader,\n};\nfoo($crate::x);";
    let names: Vec<String> = crate_paths(code).into_iter().map(|(name, _)| name).collect();
    assert_eq!(names, ["store", "io", "loader"]);
}

/// `text` without `bindgen!` invocations: the modules they generate have `super::` paths of
/// their own, which name the generated modules, not sibling files.
fn without_bindgen(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("bindgen!(") {
        out.push_str(&rest[..at]);
        let mut depth = 0usize;
        let mut end = rest.len();
        for (i, c) in rest[at + "bindgen!".len()..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + "bindgen!".len() + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[test]
fn no_two_files_of_a_module_use_each_other() {
    // Within a module, the files form layers too (mod.rs, which declares them, aside): a file
    // that needs what another holds sits above it, never beside it in a circle (issue 41 broke
    // shared.rs <-> heat.rs, planner.rs <-> rebalance.rs, attach.rs <-> cache.rs).
    use std::collections::{BTreeMap, BTreeSet};
    let mut modules: BTreeMap<PathBuf, BTreeMap<String, String>> = BTreeMap::new();
    for (path, text) in sources() {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.starts_with("python") || name == "mod" || name == "tests" || path.parent() == Some(Path::new("")) {
            continue;
        }
        let before_tests = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let code: String =
            before_tests.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
        modules.entry(path.parent().unwrap().to_path_buf()).or_default().insert(name, without_bindgen(&code));
    }
    let mut files = 0;
    for (dir, sources) in &modules {
        let module = dir.to_string_lossy().replace('/', "::");
        let uses = |code: &str, other: &str| {
            let named = |prefix: &str| {
                code.match_indices(&format!("{prefix}{other}"))
                    .any(|(at, found)| !code[at + found.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_'))
            };
            let grouped = code.match_indices("super::{").any(|(at, _)| {
                let group = &code[at + "super::{".len()..];
                let group = &group[..group.find('}').unwrap_or(group.len())];
                group.split(',').any(|item| item.trim().split("::").next() == Some(other))
            });
            named("super::") || named(&format!("crate::{module}::")) || grouped
        };
        let graph: BTreeMap<&str, BTreeSet<&str>> = sources
            .iter()
            .map(|(name, code)| {
                let edges = sources.keys().filter(|other| *other != name && uses(code, other)).map(String::as_str);
                (name.as_str(), edges.collect())
            })
            .collect();
        files += graph.len();
        // A circle is a file that reaches itself.
        for &start in graph.keys() {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<&str> = graph[start].iter().copied().collect();
            while let Some(file) = stack.pop() {
                assert!(file != start, "{}: {start}.rs and the files it uses lead back to it: a circle", dir.display());
                if seen.insert(file) {
                    stack.extend(graph[file].iter().copied());
                }
            }
        }
    }
    assert!(files >= 60, "checked the modules' files ({files})");
}
