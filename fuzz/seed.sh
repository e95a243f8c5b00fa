#!/usr/bin/env bash
# Fills fuzz/corpus/<target>/ with seeds: the config fixtures (each with two
# option bytes in front), a few RateLimitRequests encoded by hand against
# the fixtures' domains, and a few decision scenarios. Safe to run again:
# files are named by what they hold, so libFuzzer's own finds stay.
set -euo pipefail
cd "$(dirname "$0")"
root=..
mkdir -p corpus/config corpus/request corpus/decision

# --- config: mode byte 0x00 (one file) and 0x81 (merge, also a directory) ---
find "$root/tests/fixtures/config" "$root/examples" -name '*.yaml' | sort | while read -r file; do
    name=$(echo "${file#"$root"/}" | tr '/' '_')
    { printf '\x00'; cat "$file"; } > "corpus/config/$name-00"
    { printf '\x81'; cat "$file"; } > "corpus/config/$name-81"
done

# --- request: protobuf by hand (every length below 128, so one byte) ---
# ld TAG CMD...: field TAG (hex) of the bytes CMD prints, length-delimited.
ld() {
    local tag=$1 tmp
    shift
    tmp=$(mktemp)
    "$@" > "$tmp"
    printf "\\x$tag\\x$(printf %02x "$(wc -c < "$tmp")")"
    cat "$tmp"
    rm -f "$tmp"
}
str() { printf '%s' "$1"; }
entry() { ld 0a str "$1"; ld 12 str "$2"; }
# desc K V [K V...]: a descriptor's entries.
desc() { while [ $# -ge 2 ]; do ld 0a entry "$1" "$2"; shift 2; done; }
# override N UNIT: a RateLimitOverride (varints below 128).
override() { printf "\\x08\\x$(printf %02x "$1")\\x10\\x$(printf %02x "$2")"; }
desc_override() { desc "$1" "$2"; ld 12 override "$3" "$4"; }
uint64_value() { printf "\\x08\\x$(printf %02x "$1")"; }
desc_cost() { desc "$1" "$2"; ld 1a uint64_value "$3"; }

request() { # request NAME DOMAIN then descriptor commands separated by --
    local name=$1 domain=$2
    shift 2
    {
        ld 0a str "$domain"
        local args=()
        for arg in "$@" --; do
            if [ "$arg" = -- ]; then
                [ ${#args[@]} -gt 0 ] && ld 12 "${args[@]}"
                args=()
            else
                args+=("$arg")
            fi
        done
    } > "corpus/request/$name"
}
request basic-key2 test-domain desc key2 value2
request basic-nested test-domain desc key1 value1 subkey1 subvalue1
request basic-two test-domain desc key3 x -- desc key4 y
request basic-override test-domain desc_override key2 value2 5 2
request basic-cost test-domain desc_cost key2 value2 3
request wildcard wildcards desc wild foobar -- desc multiWild fooXbarYbaz
request unknown-domain nowhere desc k v
{ cat corpus/request/basic-key2; printf '\x18\x05'; } > corpus/request/basic-hits

# --- decision: four limit bytes, then (advance, shape, descriptors) steps ---
printf '\x20\x30\x50\x20\x01\x03\x00\x01\x02\x03\x80\x01\x04\x05' > corpus/decision/mixed
printf '\x20\x20\x20\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x64\x00\x00' > corpus/decision/log-burst
printf '\x24\x34\x14\x24\x00\x01\x01\x05\x81\x01\x01\x05\x82\x01\x01\x05' > corpus/decision/fixed-edges
printf '\x11\x12\x22\x33\x05\x02\x11\x31\x51\x05\x02\x12\x32\x52' > corpus/decision/buckets-costs

for target in config request decision; do
    echo "$target: $(find "corpus/$target" -type f | wc -l) files"
done
