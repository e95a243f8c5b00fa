//! Size and naming rules of the production code under src/: one type name
//! per idea, no function over 100 lines, no file over 700 lines. Test code
//! (`#[cfg(test)]` items, `tests.rs` files and `tests/` folders, the
//! `testing` module) is left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::{Attribute, ImplItem, Item, TraitItem};

const MAX_FUNCTION_LINES: usize = 100;
const MAX_FILE_LINES: usize = 700;

/// Type names that may be defined in more than one module, and why.
const SHARED_NAMES: &[(&str, &str)] = &[(
    "Error",
    "each module's own error type, always written `module::Error` where it is used",
)];

/// One production source file, parsed.
struct Source {
    path: PathBuf,
    lines: usize,
    file: syn::File,
}

/// What the rules look at in one file.
#[derive(Default)]
struct Findings {
    /// Type name to where it is defined.
    types: BTreeMap<String, Vec<String>>,
    /// Functions over the limit: where, and how long.
    long_functions: Vec<(String, usize)>,
    /// Lines of `#[cfg(test)]` items.
    test_lines: usize,
}

#[test]
fn each_type_name_is_defined_once() {
    let mut types: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for source in sources() {
        for (name, places) in findings(&source).types {
            types.entry(name).or_default().extend(places);
        }
    }
    let twice: Vec<String> = types
        .iter()
        .filter(|(name, places)| {
            places.len() > 1 && !SHARED_NAMES.iter().any(|(shared, _)| shared == name)
        })
        .map(|(name, places)| format!("{name}: {}", places.join(", ")))
        .collect();
    assert!(
        twice.is_empty(),
        "type names defined more than once (rename one, or justify the name in SHARED_NAMES):\n{}",
        twice.join("\n")
    );
    for (shared, _) in SHARED_NAMES {
        assert!(
            types.get(*shared).is_some_and(|places| places.len() > 1),
            "{shared} is in SHARED_NAMES but defined once at most: take it out"
        );
    }
}

#[test]
fn no_function_is_longer_than_100_lines() {
    let long: Vec<String> = sources()
        .iter()
        .flat_map(|source| findings(source).long_functions)
        .map(|(place, lines)| format!("{place}: {lines} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_file_is_longer_than_700_lines() {
    let long: Vec<String> = sources()
        .iter()
        .filter_map(|source| {
            let production = source.lines - findings(source).test_lines;
            (production > MAX_FILE_LINES)
                .then(|| format!("{}: {production} lines", source.path.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} production lines (tests left out):\n{}",
        long.join("\n")
    );
}

/// Every production `.rs` file under src/, parsed.
fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    collect(&root.join("src"), &mut paths);
    assert!(paths.len() > 50, "found only {} source files", paths.len());
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let file =
                syn::parse_file(&text).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
            Source {
                path: path.strip_prefix(root).unwrap().to_path_buf(),
                lines: text.lines().count(),
                file,
            }
        })
        .collect()
}

fn collect(dir: &Path, paths: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if name == "tests" || name == "tests.rs" || name == "testing" || name == "testing.rs" {
            continue;
        }
        if path.is_dir() {
            collect(&path, paths);
        } else if name.ends_with(".rs") {
            paths.push(path);
        }
    }
}

fn findings(source: &Source) -> Findings {
    let mut found = Findings::default();
    walk_items(source, &source.file.items, &mut found);
    found
}

fn walk_items(source: &Source, items: &[Item], found: &mut Findings) {
    for item in items {
        if is_test_only(item_attrs(item)) {
            let span = item.span();
            found.test_lines += span.end().line - span.start().line + 1;
            continue;
        }
        let name = match item {
            Item::Struct(it) => Some(&it.ident),
            Item::Enum(it) => Some(&it.ident),
            Item::Trait(it) => Some(&it.ident),
            Item::Type(it) => Some(&it.ident),
            Item::Union(it) => Some(&it.ident),
            _ => None,
        };
        if let Some(name) = name {
            let place = format!("{}:{}", source.path.display(), name.span().start().line);
            found.types.entry(name.to_string()).or_default().push(place);
        }
        match item {
            Item::Fn(it) => function(
                source,
                &it.sig,
                it.block.brace_token.span.close().end().line,
                found,
            ),
            Item::Impl(it) => {
                for inner in &it.items {
                    if let ImplItem::Fn(f) = inner
                        && !is_test_only(&f.attrs)
                    {
                        let end = f.block.brace_token.span.close().end().line;
                        function(source, &f.sig, end, found);
                    }
                }
            }
            Item::Trait(it) => {
                for inner in &it.items {
                    if let TraitItem::Fn(f) = inner
                        && let Some(block) = &f.default
                    {
                        let end = block.brace_token.span.close().end().line;
                        function(source, &f.sig, end, found);
                    }
                }
            }
            Item::Mod(it) => {
                if let Some((_, items)) = &it.content {
                    walk_items(source, items, found);
                }
            }
            _ => {}
        }
    }
}

fn function(source: &Source, sig: &syn::Signature, end: usize, found: &mut Findings) {
    let start = sig.fn_token.span.start().line;
    let lines = end - start + 1;
    if lines > MAX_FUNCTION_LINES {
        let place = format!("{}:{start} {}", source.path.display(), sig.ident);
        found.long_functions.push((place, lines));
    }
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(it) => &it.attrs,
        Item::Enum(it) => &it.attrs,
        Item::Fn(it) => &it.attrs,
        Item::Impl(it) => &it.attrs,
        Item::Macro(it) => &it.attrs,
        Item::Mod(it) => &it.attrs,
        Item::Static(it) => &it.attrs,
        Item::Struct(it) => &it.attrs,
        Item::Trait(it) => &it.attrs,
        Item::Type(it) => &it.attrs,
        Item::Union(it) => &it.attrs,
        Item::Use(it) => &it.attrs,
        _ => &[],
    }
}

/// `#[cfg(test)]`, exactly: items built for the tests alone.
fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr
                .parse_args::<syn::Ident>()
                .is_ok_and(|arg| arg == "test")
    })
}
