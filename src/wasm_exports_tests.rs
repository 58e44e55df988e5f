//! Inspects the built plugin .wasm: exactly one ABI marker (`proxy_abi_version_0_2_100`), the
//! callbacks Higress calls (including `proxy_on_redis_call_response`) and the Higress imports, with
//! their signatures. The .wasm must be built first (build.sh does):
//! `cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer`.
//! Parses the module with a small reader of its own (type, import, function, export sections).

use std::collections::HashMap;

const WASM: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm");

#[derive(Debug, Clone, PartialEq)]
struct FuncType {
    params: Vec<u8>,
    results: Vec<u8>,
}

#[derive(Default)]
struct Module {
    types: Vec<FuncType>,
    /// (module, name, type index) of imported functions, in index order.
    func_imports: Vec<(String, String, u32)>,
    /// Type index of each defined function.
    funcs: Vec<u32>,
    /// export name -> (kind, index)
    exports: HashMap<String, (u8, u32)>,
    export_names: Vec<String>,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let v = self.b[self.pos];
        self.pos += 1;
        v
    }
    fn leb(&mut self) -> u64 {
        let (mut result, mut shift) = (0u64, 0);
        loop {
            let byte = self.byte();
            result |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return result;
            }
            shift += 7;
        }
    }
    fn name(&mut self) -> String {
        let n = self.leb() as usize;
        let s = String::from_utf8(self.b[self.pos..self.pos + n].to_vec()).expect("utf8 name");
        self.pos += n;
        s
    }
    fn bytes_vec(&mut self) -> Vec<u8> {
        let n = self.leb() as usize;
        (0..n).map(|_| self.byte()).collect()
    }
    fn limits(&mut self) {
        let flags = self.byte();
        self.leb();
        if flags & 1 != 0 {
            self.leb();
        }
    }
}

fn parse(bytes: &[u8]) -> Module {
    assert_eq!(&bytes[0..4], b"\0asm", "not a wasm module");
    let mut m = Module::default();
    let mut r = Reader { b: bytes, pos: 8 };
    while r.pos < bytes.len() {
        let id = r.byte();
        let size = r.leb() as usize;
        let end = r.pos + size;
        match id {
            1 => {
                for _ in 0..r.leb() {
                    assert_eq!(r.byte(), 0x60, "plain function types expected");
                    let params = r.bytes_vec();
                    let results = r.bytes_vec();
                    m.types.push(FuncType { params, results });
                }
            }
            2 => {
                for _ in 0..r.leb() {
                    let module = r.name();
                    let name = r.name();
                    match r.byte() {
                        0 => {
                            let t = r.leb() as u32;
                            m.func_imports.push((module, name, t));
                        }
                        1 => {
                            r.byte();
                            r.limits();
                        }
                        2 => r.limits(),
                        3 => {
                            r.byte();
                            r.byte();
                        }
                        k => panic!("unknown import kind {k}"),
                    }
                }
            }
            3 => {
                for _ in 0..r.leb() {
                    let t = r.leb() as u32;
                    m.funcs.push(t);
                }
            }
            7 => {
                for _ in 0..r.leb() {
                    let name = r.name();
                    let kind = r.byte();
                    let idx = r.leb() as u32;
                    m.export_names.push(name.clone());
                    m.exports.insert(name, (kind, idx));
                }
            }
            _ => {}
        }
        r.pos = end;
    }
    m
}

impl Module {
    fn export_type(&self, name: &str) -> FuncType {
        let (kind, idx) =
            *self.exports.get(name).unwrap_or_else(|| panic!("export {name} missing"));
        assert_eq!(kind, 0, "{name} is not a function");
        let idx = idx as usize;
        let t = if idx < self.func_imports.len() {
            self.func_imports[idx].2
        } else {
            self.funcs[idx - self.func_imports.len()]
        };
        self.types[t as usize].clone()
    }
    fn import_type(&self, module: &str, name: &str) -> FuncType {
        let (_, _, t) = self
            .func_imports
            .iter()
            .find(|(m, n, _)| m == module && n == name)
            .unwrap_or_else(|| panic!("import {module}.{name} missing"));
        self.types[*t as usize].clone()
    }
}

const I32: u8 = 0x7f;
const I64: u8 = 0x7e;

fn ft(params: &[u8], results: &[u8]) -> FuncType {
    FuncType { params: params.to_vec(), results: results.to_vec() }
}

fn load() -> Module {
    let bytes = std::fs::read(WASM).unwrap_or_else(|e| {
        panic!(
            "{WASM}: {e}. Build the plugin first: `cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer` (./build.sh does it)"
        )
    });
    // A .wasm older than the code it is built from would pass or fail for old code.
    let built = std::fs::metadata(WASM).and_then(|m| m.modified());
    let (Ok(built), Ok((newest, path))) = (built, newest_module_source()) else {
        panic!("{WASM}: cannot read the modification times of the module and its sources")
    };
    assert!(
        newest <= built,
        "{WASM} is older than {path}: rebuild it (`./build.sh wasm`) to test the current code"
    );
    parse(&bytes)
}

/// The newest file the module is built from (the plugin's non-test sources, its Lua scripts and
/// its Cargo.toml), with its path. Test-only files are left out: editing them does not change the
/// module.
fn newest_module_source() -> std::io::Result<(std::time::SystemTime, String)> {
    fn is_test_only(p: &std::path::Path) -> bool {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        name.ends_with("_tests.rs")
            || name == "testutil.rs"
            || name == "fake.rs"
            || p.components().any(|c| c.as_os_str() == "fuzz_corpus" || c.as_os_str() == "testdata")
    }
    fn walk(
        path: &std::path::Path,
        newest: &mut (std::time::SystemTime, String),
    ) -> std::io::Result<()> {
        let md = std::fs::metadata(path)?;
        if md.is_dir() {
            for e in std::fs::read_dir(path)? {
                walk(&e?.path(), newest)?;
            }
        } else if !is_test_only(path) && md.modified()? > newest.0 {
            *newest = (md.modified()?, path.display().to_string());
        }
        Ok(())
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut newest = (std::time::UNIX_EPOCH, String::new());
    walk(&root.join("src"), &mut newest)?;
    walk(&root.join("Cargo.toml"), &mut newest)?;
    Ok(newest)
}

#[test]
fn exactly_one_abi_marker_0_2_100() {
    let m = load();
    let markers: Vec<&String> =
        m.export_names.iter().filter(|n| n.starts_with("proxy_abi_version_")).collect();
    assert_eq!(
        markers,
        vec!["proxy_abi_version_0_2_100"],
        "the host takes the first marker it finds"
    );
    assert_eq!(m.export_type("proxy_abi_version_0_2_100"), ft(&[], &[]));
}

#[test]
fn exports_the_callbacks_with_proxy_wasm_signatures() {
    let m = load();
    let expected: &[(&str, FuncType)] = &[
        ("proxy_on_memory_allocate", ft(&[I32], &[I32])),
        ("proxy_on_context_create", ft(&[I32, I32], &[])),
        ("proxy_on_vm_start", ft(&[I32, I32], &[I32])),
        ("proxy_on_configure", ft(&[I32, I32], &[I32])),
        ("proxy_on_tick", ft(&[I32], &[])),
        ("proxy_on_queue_ready", ft(&[I32, I32], &[])),
        ("proxy_on_request_headers", ft(&[I32, I32, I32], &[I32])),
        ("proxy_on_request_body", ft(&[I32, I32, I32], &[I32])),
        ("proxy_on_request_trailers", ft(&[I32, I32], &[I32])),
        ("proxy_on_response_headers", ft(&[I32, I32, I32], &[I32])),
        ("proxy_on_response_body", ft(&[I32, I32, I32], &[I32])),
        ("proxy_on_response_trailers", ft(&[I32, I32], &[I32])),
        ("proxy_on_log", ft(&[I32], &[])),
        ("proxy_on_done", ft(&[I32], &[I32])),
        ("proxy_on_delete", ft(&[I32], &[])),
        ("proxy_on_http_call_response", ft(&[I32, I32, I32, I32, I32], &[])),
        ("proxy_on_redis_call_response", ft(&[I32, I32, I32, I32], &[])),
    ];
    for (name, t) in expected {
        assert_eq!(&m.export_type(name), t, "{name}");
    }
    assert!(m.exports.contains_key("memory"));
}

#[test]
fn imports_the_higress_extensions() {
    let m = load();
    let expected: &[(&str, FuncType)] = &[
        ("proxy_redis_init", ft(&[I32, I32, I32, I32, I32, I32, I32], &[I32])),
        ("proxy_redis_call", ft(&[I32, I32, I32, I32, I32], &[I32])),
        ("proxy_get_upstream_hosts", ft(&[I32, I32], &[I32])),
        ("proxy_set_upstream_override_host", ft(&[I32, I32], &[I32])),
        ("proxy_set_effective_context", ft(&[I32], &[I32])),
        ("proxy_get_buffer_bytes", ft(&[I32, I32, I32, I32, I32], &[I32])),
        ("proxy_continue_stream", ft(&[I32], &[I32])),
        ("proxy_send_local_response", ft(&[I32, I32, I32, I32, I32, I32, I32, I32], &[I32])),
        ("proxy_http_call", ft(&[I32, I32, I32, I32, I32, I32, I32, I32, I32, I32], &[I32])),
        ("proxy_increment_metric", ft(&[I32, I64], &[I32])),
    ];
    for (name, t) in expected {
        assert_eq!(&m.import_type("env", name), t, "env.{name}");
    }
    // Nothing from the crates.io SDK's world that Higress would not provide.
    for (module, name, _) in &m.func_imports {
        assert!(
            module == "env" || module == "wasi_snapshot_preview1",
            "unexpected import {module}.{name}"
        );
    }
}
