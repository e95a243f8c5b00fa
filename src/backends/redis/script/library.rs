//! Our Lua code as Redis runs it: the decision and refund scripts
//! (EVALSHA) and the same code as one function library (FCALL).
//!
//! Invariant: a library's name and functions carry the digest of its
//! code, so two versions of the service sharing a server each call their
//! own.

/// The helpers both scripts share (`lua/common.lua`).
const COMMON_LUA: &str = include_str!("../../../../lua/common.lua");
/// The decision's definitions (`lua/decide.lua`): `decide` and `decide_batch`.
const DECIDE_DEFINITIONS: &str = include_str!("../../../../lua/decide.lua");
/// The refund's definitions (`lua/refund.lua`): `refund`.
const REFUND_DEFINITIONS: &str = include_str!("../../../../lua/refund.lua");

/// The decision of one request as a script (EVALSHA, for servers without
/// functions), embedded at build time after the helpers it shares with the
/// refund. The function library runs the very same text.
pub const DECIDE_LUA: &str = concat!(
    include_str!("../../../../lua/common.lua"),
    include_str!("../../../../lua/decide.lua"),
    "\nreturn decide(KEYS, ARGV)\n"
);

/// The decision of several requests in one call as a script (see
/// [`BATCH_FIELDS`]).
pub const DECIDE_BATCH_LUA: &str = concat!(
    include_str!("../../../../lua/common.lua"),
    include_str!("../../../../lua/decide.lua"),
    "\nreturn decide_batch(KEYS, ARGV)\n"
);

/// The refund script, embedded at build time (see the module's "Refunds").
pub const REFUND_LUA: &str = concat!(
    include_str!("../../../../lua/common.lua"),
    include_str!("../../../../lua/refund.lua"),
    "\nreturn refund(KEYS, ARGV)\n"
);

/// The refund script, invoked by EVALSHA (with SCRIPT LOAD on NOSCRIPT).
pub fn refund_script() -> redis::Script {
    redis::Script::new(REFUND_LUA)
}

/// The decision and the refund as one Redis function library (Redis 7):
/// loaded once per server with FUNCTION LOAD, called with FCALL, so a call
/// runs only the decision, not the definitions of every helper.
///
/// Function names are global in a server, and two versions of the service
/// may share one during a rolling upgrade: the library and its functions
/// carry the first 12 hex digits of the SHA1 of the library's body, so each
/// version calls its own code and loading an identical library again is
/// answered "already exists" (which is success).
///
/// At load time Redis 7.0 lets a library's top level reach only
/// `redis.register_function`: the scripts' text (whose top level reads
/// `string`, `math`, `redis.call`...) is therefore the body of a builder
/// function, run at the first call of the library's functions on that
/// server and kept for every later call.
#[derive(Debug)]
pub struct Library {
    /// The library's name, `throttlegate_<digest>`.
    pub name: String,
    /// One request: the layout of [`HEADER_FIELDS`] and [`LIMIT_FIELDS`].
    pub decide: String,
    /// Several requests: the layout of [`BATCH_FIELDS`].
    pub decide_batch: String,
    /// A refund: the layout of [`REFUND_HEADER_FIELDS`] and [`REFUND_FIELDS`].
    pub refund: String,
    /// What FUNCTION LOAD is sent.
    pub source: String,
}

/// The library, built once.
pub fn library() -> &'static Library {
    static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(Library::build);
    &LIBRARY
}

impl Library {
    fn build() -> Library {
        let definitions = format!(
            "local function decide_functions()\n{COMMON_LUA}{DECIDE_DEFINITIONS}\n\
             return decide, decide_batch\nend\n\
             local function refund_function()\n{COMMON_LUA}{REFUND_DEFINITIONS}\n\
             return refund\nend\n"
        );
        // The digest of the code alone: the names written below derive from it.
        let digest = redis::Script::new(&definitions).get_hash()[..12].to_owned();
        let name = format!("throttlegate_{digest}");
        let decide = format!("throttlegate_decide_{digest}");
        let decide_batch = format!("throttlegate_decide_batch_{digest}");
        let refund = format!("throttlegate_refund_{digest}");
        let source = format!(
            "#!lua name={name}\n{definitions}\
             local decide, decide_batch, refund\n\
             redis.register_function('{decide}', function(keys, args)\n\
             \x20 if not decide then decide, decide_batch = decide_functions() end\n\
             \x20 return decide(keys, args)\nend)\n\
             redis.register_function('{decide_batch}', function(keys, args)\n\
             \x20 if not decide then decide, decide_batch = decide_functions() end\n\
             \x20 return decide_batch(keys, args)\nend)\n\
             redis.register_function('{refund}', function(keys, args)\n\
             \x20 if not refund then refund = refund_function() end\n\
             \x20 return refund(keys, args)\nend)\n"
        );
        Library {
            name,
            decide,
            decide_batch,
            refund,
            source,
        }
    }
}
