use super::*;

fn args(cmd: &Cmd) -> Vec<Vec<u8>> {
    cmd.args_iter()
        .filter_map(|it| match it {
            redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
            _ => None,
        })
        .collect()
}

#[test]
fn an_fcall_becomes_the_evalsha_of_the_same_code_and_arguments() {
    let mut fcall = Engine::Functions.command(LuaEntry::Decide, 2);
    fcall.arg("k1").arg("k2").arg("a").arg(b"\xff".as_slice());
    let mut evalsha = Engine::Scripts.command(LuaEntry::Decide, 2);
    evalsha.arg("k1").arg("k2").arg("a").arg(b"\xff".as_slice());
    assert_eq!(args(&as_script(&fcall, LuaEntry::Decide)), args(&evalsha));
}

#[test]
fn library_names_are_read_from_either_protocol() {
    let text = |it: &str| Value::BulkString(it.as_bytes().to_vec());
    let resp2 = Value::Array(vec![Value::Array(vec![
        text("library_name"),
        text("throttlegate_0123456789ab"),
        text("engine"),
        text("LUA"),
    ])]);
    let resp3 = Value::Array(vec![Value::Map(vec![
        (text("engine"), text("LUA")),
        (text("library_name"), text("other")),
    ])]);
    assert_eq!(library_names(&resp2), ["throttlegate_0123456789ab"]);
    assert_eq!(library_names(&resp3), ["other"]);
    assert!(library_names(&Value::Nil).is_empty());
}

#[test]
fn only_throttlegate_digests_are_library_names() {
    assert!(is_library_name("throttlegate_0123456789ab"));
    assert!(!is_library_name("throttlegate_"));
    assert!(!is_library_name("throttlegate_decide_0123456789ab"));
    assert!(!is_library_name("someone_else"));
}
