//! Two tuples of key parts give the same lock key exactly when they are the
//! same tuple (reliability.md R10: keys that cannot collide), every key keeps
//! its whole name and parts inside one Redis Cluster hash tag, and a key too
//! long is a typed error, never a truncation.
#![no_main]

use arbitrary::Arbitrary;
use dlock_core::{Error, LockKey, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

/// A part as a handler or a layer can produce it. Numbers are written as
/// their decimal text, so `Int(7)` and `Text("7")` are the same part by
/// design (one route always puts the same type in one position).
#[derive(Debug, Arbitrary)]
enum Part {
    Text(String),
    Maybe(Option<String>),
    Int(i64),
    Char(char),
}

impl Part {
    /// What the part means: `None`, or the text it stands for.
    fn meaning(&self) -> Option<String> {
        match self {
            Part::Text(s) => Some(s.clone()),
            Part::Maybe(m) => m.clone(),
            Part::Int(n) => Some(n.to_string()),
            Part::Char(c) => Some(c.to_string()),
        }
    }
}

fn key(name: &str, parts: &[Part]) -> Result<LockKey, Error> {
    let mut b = LockKey::builder("dlock", name);
    for p in parts {
        match p {
            Part::Text(s) => b.push(s.as_str()),
            Part::Maybe(m) => b.push(m.as_deref()),
            Part::Int(n) => b.push(*n),
            Part::Char(c) => b.push(*c),
        }
    }
    b.build()
}

fn check_shape(k: &LockKey) {
    let s = k.as_str();
    assert!(s.len() <= MAX_KEY_LEN, "{s:?} is longer than the cap");
    // The hash tag is the text between the first `{` and the first `}`
    // after it: it must be the whole name and parts.
    assert_eq!(s.find('{'), Some("dlock:".len()), "{s:?}");
    assert_eq!(s.find('}'), Some(s.len() - 1), "{s:?}");
}

/// How the second tuple is made from the first: the near misses a
/// separator-joined format would confuse (random pairs almost never are).
#[derive(Debug, Arbitrary)]
enum Twist {
    /// An unrelated tuple.
    Other(String, Vec<Part>),
    /// Parts `i..=j` joined by `sep` into one text part.
    Join { i: u8, j: u8, sep: Sep },
    /// Part `i` split at its first `sep`.
    Split { i: u8, sep: Sep },
    /// Part `i` replaced by what a "no value" could be written as.
    Absent { i: u8, as_text: u8 },
    /// The name takes the first part (`name:part` vs `name`, `part`).
    Shift { sep: Sep },
}

#[derive(Debug, Arbitrary, Clone, Copy)]
enum Sep {
    Colon,
    Slash,
    Brace,
    Percent,
    Escaped,
}

impl Sep {
    fn text(self) -> &'static str {
        match self {
            Sep::Colon => ":",
            Sep::Slash => "/",
            Sep::Brace => "}:{",
            Sep::Percent => "%",
            Sep::Escaped => "%3A",
        }
    }
}

fn text(p: &Part) -> String {
    p.meaning().unwrap_or_default()
}

fn twist(name: &str, a: &[Part], how: Twist) -> (String, Vec<Part>) {
    let copy = |a: &[Part]| a.iter().map(|p| Part::Maybe(p.meaning())).collect::<Vec<_>>();
    let n = a.len();
    match how {
        Twist::Other(name, parts) => (name, parts),
        Twist::Join { i, j, sep } if n > 0 => {
            let (i, j) = (usize::from(i) % n, usize::from(j) % n);
            let (i, j) = (i.min(j), i.max(j));
            let mut b = copy(&a[..i]);
            b.push(Part::Text(a[i..=j].iter().map(text).collect::<Vec<_>>().join(sep.text())));
            b.extend(copy(&a[j + 1..]));
            (name.to_owned(), b)
        }
        Twist::Split { i, sep } if n > 0 => {
            let i = usize::from(i) % n;
            let t = text(&a[i]);
            let mut b = copy(&a[..i]);
            match t.split_once(sep.text()) {
                Some((x, y)) => b.extend([Part::Text(x.to_owned()), Part::Text(y.to_owned())]),
                None => b.push(Part::Text(t)),
            }
            b.extend(copy(&a[i + 1..]));
            (name.to_owned(), b)
        }
        Twist::Absent { i, as_text } if n > 0 => {
            let i = usize::from(i) % n;
            let mut b = copy(a);
            b[i] = match as_text % 5 {
                0 => Part::Maybe(None),
                1 => Part::Text("None".into()),
                2 => Part::Text("null".into()),
                3 => Part::Text(String::new()),
                _ => Part::Text("%N".into()),
            };
            (name.to_owned(), b)
        }
        Twist::Shift { sep } if n > 0 => (format!("{name}{}{}", sep.text(), text(&a[0])), copy(&a[1..])),
        _ => (name.to_owned(), vec![Part::Maybe(None)]),
    }
}

fuzz_target!(|input: (String, Vec<Part>, Twist)| {
    let (name_a, a, how) = input;
    let (name_b, b) = twist(&name_a, &a, how);
    let (ka, kb) = (key(&name_a, &a), key(&name_b, &b));
    for k in [&ka, &kb] {
        match k {
            Ok(k) => check_shape(k),
            Err(Error::InvalidKey(msg)) => assert!(msg.contains("bytes long"), "{msg}"),
            Err(other) => panic!("a key can only be refused for its length, not {other:?}"),
        }
    }
    if let (Ok(ka), Ok(kb)) = (ka, kb) {
        let same_input =
            name_a == name_b && a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.meaning() == y.meaning());
        assert_eq!(ka == kb, same_input, "{ka:?} vs {kb:?} from {name_a:?} {a:?} / {name_b:?} {b:?}");
    }
});
