//! The canonical form of a JSON request body ([`canonical_json`]), with a
//! parser of its own (no JSON crate in dlock-core): one pass, no `f64`,
//! bounded recursion.

use std::borrow::Cow;

/// Deepest nesting of arrays and objects given a canonical form (as
/// serde_json's default recursion limit): bounds the parser's recursion.
const MAX_DEPTH: usize = 128;

/// The bytes the fingerprint covers for `body`: its [`canonical_json`] when
/// the request declares a JSON body (`json`, from its `Content-Type`) and
/// the body has a canonical form, else the body as it is.
///
/// ```
/// use dlock_core::idempotency::canonical_body;
/// let a = canonical_body(br#"{"from":1,"to":2,"amount":1}"#, true);
/// let b = canonical_body(br#"{ "to": 2, "amount": 1, "from": 1 }"#, true);
/// assert_eq!(a, b);
/// assert_eq!(&*a, br#"{"amount":1,"from":1,"to":2}"#);
/// // Not declared as JSON, or not JSON: the bytes.
/// assert_eq!(&*canonical_body(br#"{ "to": 2 }"#, false), br#"{ "to": 2 }"#);
/// assert_eq!(&*canonical_body(b"amount=1", true), b"amount=1");
/// ```
pub fn canonical_body(body: &[u8], json: bool) -> Cow<'_, [u8]> {
    match json.then(|| canonical_json(body)).flatten() {
        Some(canonical) => Cow::Owned(canonical),
        None => Cow::Borrowed(body),
    }
}

/// The canonical form of the JSON `body`, or `None` when it has none: the
/// same bytes for every spelling of the same JSON, so that a client that
/// re-serialises its object for a retry (another key order, other
/// whitespace, `"\u00e9"` for `"é"`) is fingerprinted as the same request
/// ([`fingerprint`](super::fingerprint)), not `422 idempotency_key_mismatch`.
///
/// * No whitespace outside strings.
/// * The members of every object in order of their keys' UTF-8 bytes (that
///   is, of their code points), at every depth; arrays keep their order.
/// * Strings as their characters, with only `"`, `\` and the control
///   characters escaped (`\n`, `\r`, `\t`, `\b`, `\f`, else `\u00XX`): `"\u00e9"`,
///   `"\u00E9"` and `"é"` are one string, as are `"\/"` and `"/"`. No Unicode
///   normalisation: `"e\u0301"` is not `"é"`.
/// * **Numbers exactly as written**: `1` and `1.0`, `100` and `1e2`, `0` and
///   `-0` stay apart. Read as `f64`, `0.1` and `0.10000000000000000001`
///   would be one fingerprint, and replay one request's answer for another;
///   serialisers write the same value the same way each time.
///
/// `None` for a body that is not exactly one JSON value by RFC 8259, for
/// an object with a key twice (parsers disagree on which counts), and past
/// 128 levels of nesting: [`canonical_body`] then fingerprints the bytes.
///
/// ```
/// use dlock_core::idempotency::canonical_json;
/// assert_eq!(canonical_json(br#"{"b":[1.0, "\u00e9"],"a":{"y":null,"x":true}}"#).as_deref(),
///            Some(r#"{"a":{"x":true,"y":null},"b":[1.0,"é"]}"#.as_bytes()));
/// assert_eq!(canonical_json(br#"{"a":1,"a":2}"#), None);
/// assert_eq!(canonical_json(b"{"), None);
/// ```
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    // Checked once, so raw runs of bytes copy as whole characters.
    std::str::from_utf8(body).ok()?;
    let mut parser = Parser { input: body, pos: 0, out: Vec::with_capacity(body.len()) };
    parser.skip_whitespace();
    parser.value(0).ok()?;
    parser.skip_whitespace();
    (parser.pos == body.len()).then_some(parser.out)
}

/// Why a body has no canonical form; only ever turned into "use the bytes".
#[derive(Debug)]
struct NoCanonicalForm;

type Parsed = Result<(), NoCanonicalForm>;

/// A one-pass reader of `input` that writes the canonical form to `out`.
struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn next(&mut self) -> Result<u8, NoCanonicalForm> {
        let b = self.peek().ok_or(NoCanonicalForm)?;
        self.pos += 1;
        Ok(b)
    }

    fn expect(&mut self, want: u8) -> Parsed {
        if self.next()? == want {
            Ok(())
        } else {
            Err(NoCanonicalForm)
        }
    }

    /// RFC 8259's whitespace: space, tab, line feed, carriage return.
    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// One value at nesting `depth`, its canonical text appended to `out`.
    fn value(&mut self, depth: usize) -> Parsed {
        match self.peek().ok_or(NoCanonicalForm)? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => {
                let s = self.string()?;
                write_string(&mut self.out, &s);
                Ok(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => Err(NoCanonicalForm),
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Parsed {
        let end = self.pos + word.len();
        if self.input.get(self.pos..end) != Some(word) {
            return Err(NoCanonicalForm);
        }
        self.out.extend_from_slice(word);
        self.pos = end;
        Ok(())
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, copied as
    /// written; what follows is the caller's to check.
    fn number(&mut self) -> Parsed {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return Err(NoCanonicalForm),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            self.some_digits()?;
        }
        self.out.extend_from_slice(&self.input[start..self.pos]);
        Ok(())
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
    }

    fn some_digits(&mut self) -> Parsed {
        let start = self.pos;
        self.digits();
        if self.pos == start {
            Err(NoCanonicalForm)
        } else {
            Ok(())
        }
    }

    /// A string (at its opening quote), decoded.
    fn string(&mut self) -> Result<String, NoCanonicalForm> {
        self.expect(b'"')?;
        let mut s = String::new();
        loop {
            // A run of plain bytes ends at an ASCII byte: whole characters.
            let run = self.pos;
            while matches!(self.peek(), Some(b) if b != b'"' && b != b'\\' && b >= 0x20) {
                self.pos += 1;
            }
            s.push_str(std::str::from_utf8(&self.input[run..self.pos]).map_err(|_| NoCanonicalForm)?);
            match self.next()? {
                b'"' => return Ok(s),
                b'\\' => s.push(self.escape()?),
                // A control character must be escaped in JSON.
                _ => return Err(NoCanonicalForm),
            }
        }
    }

    /// The character of an escape (after its backslash).
    fn escape(&mut self) -> Result<char, NoCanonicalForm> {
        Ok(match self.next()? {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self.hex4()?;
                match unit {
                    0xD800..=0xDBFF => {
                        // A high surrogate must be followed by a low one.
                        self.expect(b'\\')?;
                        self.expect(b'u')?;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(NoCanonicalForm);
                        }
                        let c = 0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                        char::from_u32(c).ok_or(NoCanonicalForm)?
                    }
                    // An unpaired low surrogate is no character.
                    0xDC00..=0xDFFF => return Err(NoCanonicalForm),
                    _ => char::from_u32(u32::from(unit)).ok_or(NoCanonicalForm)?,
                }
            }
            _ => return Err(NoCanonicalForm),
        })
    }

    fn hex4(&mut self) -> Result<u16, NoCanonicalForm> {
        let mut unit = 0u16;
        for _ in 0..4 {
            let digit = char::from(self.next()?).to_digit(16).ok_or(NoCanonicalForm)?;
            // Four hex digits fit in 16 bits.
            unit = (unit << 4) | u16::try_from(digit).map_err(|_| NoCanonicalForm)?;
        }
        Ok(unit)
    }

    fn array(&mut self, depth: usize) -> Parsed {
        if depth > MAX_DEPTH {
            return Err(NoCanonicalForm);
        }
        self.expect(b'[')?;
        self.out.push(b'[');
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            self.value(depth)?;
            self.skip_whitespace();
            match self.next()? {
                b',' => self.out.push(b','),
                b']' => {
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(NoCanonicalForm),
            }
        }
    }

    /// An object, its members written back in key order.
    fn object(&mut self, depth: usize) -> Parsed {
        if depth > MAX_DEPTH {
            return Err(NoCanonicalForm);
        }
        self.expect(b'{')?;
        self.skip_whitespace();
        let mut members: Vec<(String, Vec<u8>)> = Vec::new();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                let key = self.string()?;
                self.skip_whitespace();
                self.expect(b':')?;
                self.skip_whitespace();
                let start = self.out.len();
                self.value(depth)?;
                members.push((key, self.out.split_off(start)));
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b'}' => break,
                    _ => return Err(NoCanonicalForm),
                }
            }
        }
        // `str`'s order is its UTF-8 bytes' order, which is code point order.
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if members.windows(2).any(|pair| pair[0].0 == pair[1].0) {
            return Err(NoCanonicalForm);
        }
        self.out.push(b'{');
        for (i, (key, value)) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            write_string(&mut self.out, key);
            self.out.push(b':');
            self.out.extend_from_slice(value);
        }
        self.out.push(b'}');
        Ok(())
    }
}

/// `s` as a JSON string with only what must be escaped escaped.
fn write_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            c if u32::from(c) < 0x20 => {
                let b = u32::from(c) as usize;
                out.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[b >> 4], HEX[b & 0xf]]);
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(s: &str) -> Option<String> {
        canonical_json(s.as_bytes()).map(|b| String::from_utf8(b).expect("canonical JSON is UTF-8"))
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let expect = Some(r#"{"amount":1,"from":1,"to":2}"#.to_owned());
        assert_eq!(canonical(r#"{"from":1,"to":2,"amount":1}"#), expect);
        assert_eq!(canonical(r#"{"to":2,"from":1,"amount":1}"#), expect);
        assert_eq!(canonical("\r\n\t{ \"to\" : 2 ,\n \"amount\":1,\"from\" :1 }\n"), expect);
    }

    #[test]
    fn nested_objects_are_sorted_and_arrays_keep_their_order() {
        assert_eq!(
            canonical(r#"{"z":[{"b":1,"a":2},[],{}],"a":{"d":{"f":0,"e":0},"c":null}}"#).as_deref(),
            Some(r#"{"a":{"c":null,"d":{"e":0,"f":0}},"z":[{"a":2,"b":1},[],{}]}"#)
        );
        assert_ne!(canonical("[1,2]"), canonical("[2,1]"));
    }

    /// Keys sort by code point, not by UTF-16 unit or by escape spelling.
    #[test]
    fn keys_sort_by_their_characters() {
        assert_eq!(
            canonical(r#"{"é":1,"\u0065":2,"E":3,"😀":4,"\uffff":5}"#).as_deref(),
            Some("{\"E\":3,\"e\":2,\"é\":1,\"\u{ffff}\":5,\"😀\":4}")
        );
    }

    #[test]
    fn numbers_are_kept_as_written() {
        for n in
            ["0", "-0", "1", "1.0", "1.00", "1e2", "1E2", "1e+2", "100", "-12.5e-3", "0.1", "0.10000000000000000001"]
        {
            assert_eq!(canonical(n).as_deref(), Some(n), "{n}");
        }
        assert_ne!(canonical("1"), canonical("1.0"));
        assert_ne!(canonical("100"), canonical("1e2"));
        // Beyond 64 bits and beyond f64's 53-bit mantissa: told apart.
        assert_ne!(canonical("12345678901234567890123"), canonical("12345678901234567890124"));
        assert_ne!(canonical("9007199254740993"), canonical("9007199254740992"));
    }

    #[test]
    fn strings_are_their_characters() {
        assert_eq!(canonical(r#""\u00e9""#), canonical(r#""é""#));
        assert_eq!(canonical(r#""\u00E9""#), canonical(r#""é""#));
        assert_eq!(canonical(r#""\/""#).as_deref(), Some(r#""/""#));
        assert_eq!(canonical(r#""\ud83d\ude00""#).as_deref(), Some("\"😀\""));
        assert_eq!(
            canonical(r#""a\"b\\c\n\u0001\u001f\u007f""#).as_deref(),
            Some("\"a\\\"b\\\\c\\n\\u0001\\u001f\u{7f}\"")
        );
        assert_eq!(canonical(r#""\b\f\r\t""#).as_deref(), Some(r#""\b\f\r\t""#));
        assert_ne!(canonical(r#""e\u0301""#), canonical(r#""é""#), "no Unicode normalisation");
    }

    #[test]
    fn what_is_not_one_json_value_has_no_canonical_form() {
        for bad in [
            "",
            " ",
            "{",
            "}",
            "[1,]",
            "[,1]",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{a:1}",
            "{\"a\":1}{}",
            "{\"a\":1} x",
            "01",
            "-",
            "1.",
            ".5",
            "1e",
            "+1",
            "0x10",
            "NaN",
            "Infinity",
            "tru",
            "nul",
            "'a'",
            "\"a",
            "\"\t\"",
            r#""\x""#,
            r#""\u12""#,
            r#""\ud800""#,
            r#""\ud800x""#,
            r#""\ud800\u0041""#,
            r#""\udc00""#,
            "\u{feff}{}",
            "{\"a\":1,\"a\":1}",
            "{\"a\":1,\"\\u0061\":2}",
        ] {
            assert_eq!(canonical(bad), None, "{bad:?}");
        }
        assert_eq!(canonical_json(b"\"\xff\""), None, "not UTF-8");
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(canonical(&deep(MAX_DEPTH)), Some(deep(MAX_DEPTH)));
        assert_eq!(canonical(&deep(MAX_DEPTH + 1)), None);
        let objects = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
        assert_eq!(canonical(&objects(MAX_DEPTH)), Some(objects(MAX_DEPTH)));
        assert_eq!(canonical(&objects(MAX_DEPTH + 1)), None);
        // Far deeper than any stack would take unbounded: refused, no overflow.
        assert_eq!(canonical(&deep(1_000_000)), None);
    }

    #[test]
    fn the_body_falls_back_to_its_bytes() {
        assert!(matches!(canonical_body(b"{ }", true), Cow::Owned(ref b) if b == b"{}"));
        assert!(matches!(canonical_body(b"{ }", false), Cow::Borrowed(b"{ }")));
        assert!(matches!(canonical_body(b"{ ", true), Cow::Borrowed(b"{ ")));
        assert!(matches!(canonical_body(b"", true), Cow::Borrowed(b"")));
    }

    /// A JSON value for the properties: objects with distinct keys.
    #[derive(Debug, Clone)]
    enum Json {
        Null,
        Bool(bool),
        Number(String),
        String(String),
        Array(Vec<Json>),
        Object(Vec<(String, Json)>),
    }

    fn json() -> impl Strategy<Value = Json> {
        let number = prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u128>().prop_map(|n| n.to_string()),
            (any::<i32>(), 0u32..1000, -20i32..20).prop_map(|(i, f, e)| format!("{i}.{f}e{e}")),
        ];
        let leaf = prop_oneof![
            Just(Json::Null),
            any::<bool>().prop_map(Json::Bool),
            number.prop_map(Json::Number),
            any::<String>().prop_map(Json::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| Json::Object(m.into_iter().collect())),
            ]
        })
    }

    /// How a client may write a value: member order, whitespace, escapes.
    fn write(v: &Json, order: u64, spaces: bool, escape: bool, out: &mut String) {
        let ws = if spaces { " \n" } else { "" };
        let string = |s: &str, out: &mut String| {
            out.push('"');
            for c in s.chars() {
                if escape || c == '"' || c == '\\' || u32::from(c) < 0x20 {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                } else {
                    out.push(c);
                }
            }
            out.push('"');
        };
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(n),
            Json::String(s) => string(s, out),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(ws);
                    write(item, order, spaces, escape, out);
                }
                out.push_str(ws);
                out.push(']');
            }
            Json::Object(members) => {
                let mut members: Vec<_> = members.iter().collect();
                let len = members.len().max(1);
                members.rotate_left(usize::try_from(order).unwrap_or(0) % len);
                if order % 2 == 1 {
                    members.reverse();
                }
                out.push('{');
                for (i, (key, value)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(ws);
                    string(key, out);
                    out.push_str(ws);
                    out.push(':');
                    out.push_str(ws);
                    write(value, order / 3 + 1, spaces, escape, out);
                }
                out.push_str(ws);
                out.push('}');
            }
        }
    }

    fn written(v: &Json, order: u64, spaces: bool, escape: bool) -> String {
        let mut out = String::new();
        write(v, order, spaces, escape, &mut out);
        out
    }

    proptest! {
        /// Every spelling of one value has one canonical form, and the
        /// canonical form is its own.
        #[test]
        fn every_spelling_of_a_value_is_one_canonical_form(
            v in json(), order in any::<u64>(), spaces in any::<bool>(), escape in any::<bool>()
        ) {
            let plain = canonical(&written(&v, 0, false, false));
            prop_assert!(plain.is_some());
            prop_assert_eq!(&canonical(&written(&v, order, spaces, escape)), &plain);
            prop_assert_eq!(&canonical(plain.as_deref().unwrap_or_default()), &plain);
        }

        /// Two values that differ in one leaf have different forms.
        #[test]
        fn a_changed_number_changes_the_form(v in json(), n in any::<u64>()) {
            let a = Json::Array(vec![v.clone(), Json::Number(n.to_string())]);
            let b = Json::Array(vec![v, Json::Number(n.wrapping_add(1).to_string())]);
            prop_assert_ne!(canonical(&written(&a, 0, false, false)), canonical(&written(&b, 0, false, false)));
        }
    }
}
