//! Reading only the JSON fields a key needs: the whole body is checked to be
//! one valid JSON value (as a [`Value`] parse checks it), but only the values
//! on the way to key fields are kept. Why: `docs/axum-design.md`.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

/// What to keep of a JSON value.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Want {
    /// Nothing is read from the body.
    #[default]
    Nothing,
    /// The whole value: a key field ends here.
    All,
    /// Only these members (object keys, or array indices as text), each
    /// with what to keep of it.
    Members(Vec<(String, Want)>),
}

impl Want {
    /// Adds a field path (`["product", "id"]`).
    pub(crate) fn add(&mut self, segments: &[String]) {
        let Some((first, rest)) = segments.split_first() else {
            *self = Want::All;
            return;
        };
        if let Want::Nothing = self {
            *self = Want::Members(Vec::new());
        }
        if let Want::Members(members) = self {
            let at = match members.iter().position(|(name, _)| name == first) {
                Some(at) => at,
                None => {
                    members.push((first.clone(), Want::Nothing));
                    members.len() - 1
                }
            };
            members[at].1.add(rest);
        }
        // `All` already keeps everything below it.
    }
}

/// What [`read`] kept of a JSON value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Picked {
    /// The value as parsed: a key field ends here, or a scalar blocks the path.
    Whole(Value),
    /// An object or array on the way to key fields: slot `i` for the `i`-th of
    /// its [`Want::Members`], `None` when the document has no such member.
    Members(Vec<Option<Picked>>),
}

impl Picked {
    /// Walks `segments` down, finding exactly what the same walk finds in the
    /// whole document; `want` is what [`read`] was given.
    pub(crate) fn lookup<'a>(&'a self, want: &Want, segments: &[String]) -> Option<&'a Value> {
        match (self, want) {
            (Picked::Whole(value), _) => lookup(value, segments),
            (Picked::Members(slots), Want::Members(members)) => {
                let (first, rest) = segments.split_first()?;
                let i = members.iter().position(|(name, _)| name == first)?;
                slots.get(i)?.as_ref()?.lookup(&members[i].1, rest)
            }
            // Slots are only made for a `Members` want.
            (Picked::Members(_), _) => None,
        }
    }
}

/// Walks `segments` (object keys, or indices into arrays) down from `root`.
pub(crate) fn lookup<'a>(root: &'a Value, segments: &[String]) -> Option<&'a Value> {
    segments.iter().try_fold(root, |cur, seg| match cur {
        Value::Object(map) => map.get(seg),
        Value::Array(items) => seg.parse::<usize>().ok().and_then(|i| items.get(i)),
        _ => None,
    })
}

/// Parses `body` as one JSON value and keeps, in slots, what `want` names.
pub(crate) fn read(body: &[u8], want: &Want) -> serde_json::Result<Picked> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let picked = Pruned(want).deserialize(&mut de)?;
    de.end()?;
    Ok(picked)
}

struct Pruned<'w>(&'w Want);

impl<'de> DeserializeSeed<'de> for Pruned<'_> {
    type Value = Picked;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Picked, D::Error> {
        match self.0 {
            Want::All => Value::deserialize(d).map(Picked::Whole),
            Want::Nothing => {
                Skip.deserialize(d)?;
                Ok(Picked::Whole(Value::Null))
            }
            Want::Members(members) => d.deserialize_any(Members(members)),
        }
    }
}

/// Visits a value on the way to key fields, keeping only the wanted members.
struct Members<'w>(&'w [(String, Want)]);

impl Members<'_> {
    fn position(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|(wanted, _)| wanted == name)
    }

    /// The members naming array element `index`, matched as numbers, as the
    /// lookup parses them (`items.01` is element 1).
    fn of_index(&self, index: usize) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().enumerate().filter(move |(_, (wanted, _))| wanted.parse::<usize>() == Ok(index)).map(|(i, _)| i)
    }

    fn empty_slots(&self) -> Vec<Option<Picked>> {
        std::iter::repeat_with(|| None).take(self.0.len()).collect()
    }
}

impl<'de> Visitor<'de> for Members<'_> {
    type Value = Picked;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Picked, A::Error> {
        let mut slots = self.empty_slots();
        while let Some(found) = map.next_key_seed(KeyIn(&self))? {
            match found {
                // The last duplicate wins, as when parsing into a `Value`.
                Some(i) => slots[i] = Some(map.next_value_seed(Pruned(&self.0[i].1))?),
                None => map.next_value_seed(Skip)?,
            }
        }
        Ok(Picked::Members(slots))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Picked, A::Error> {
        let mut slots = self.empty_slots();
        let mut index = 0usize;
        loop {
            let mut wanted = self.of_index(index);
            match (wanted.next(), wanted.next()) {
                (None, _) => {
                    if seq.next_element_seed(Skip)?.is_none() {
                        break;
                    }
                }
                (Some(i), None) => match seq.next_element_seed(Pruned(&self.0[i].1))? {
                    Some(picked) => slots[i] = Some(picked),
                    None => break,
                },
                // Several names for one element (`1` and `01`) may want
                // different parts of it: each gets it whole.
                (Some(_), Some(_)) => match seq.next_element_seed(Pruned(&Want::All))? {
                    Some(picked) => {
                        for i in self.of_index(index) {
                            slots[i] = Some(picked.clone());
                        }
                    }
                    None => break,
                },
            }
            index += 1;
        }
        Ok(Picked::Members(slots))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::from(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::from(v)))
    }

    fn visit_unit<E>(self) -> Result<Picked, E> {
        Ok(Picked::Whole(Value::Null))
    }
}

/// Skips one value through `deserialize_any`, not `IgnoredAny`'s fast path,
/// so nesting and number range are checked as a `Value` parse checks them.
struct Skip;

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(Skip)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(Skip)?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip)?.is_some() {}
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// An object key, compared without allocating (borrowed when it has no escapes).
struct KeyIn<'a, 'w>(&'a Members<'w>);

impl<'de> DeserializeSeed<'de> for KeyIn<'_, '_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIn<'_, '_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.position(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn segs(path: &str) -> Vec<String> {
        path.split('.').map(str::to_owned).collect()
    }

    #[test]
    fn lookup_walks_objects_and_arrays() {
        let v = json!({"product": {"id": 7, "tags": ["a", {"sku": "x"}]}});
        assert_eq!(lookup(&v, &segs("product.id")), Some(&json!(7)));
        assert_eq!(lookup(&v, &segs("product.tags.1.sku")), Some(&json!("x")));
        assert_eq!(lookup(&v, &segs("product.tags.9")), None);
        assert_eq!(lookup(&v, &segs("product.id.x")), None);
        assert_eq!(lookup(&v, &segs("nope")), None);
    }

    fn want(paths: &[&str]) -> (Want, Vec<Vec<String>>) {
        let mut w = Want::Nothing;
        let segs: Vec<Vec<String>> = paths.iter().map(|p| p.split('.').map(str::to_owned).collect()).collect();
        for s in &segs {
            w.add(s);
        }
        (w, segs)
    }

    /// Every path finds in the pruned value exactly what it finds in the
    /// whole document, including where it finds nothing.
    #[test]
    fn pruned_lookups_equal_full_lookups() {
        let doc = json!({
            "product": {"id": 7, "tags": ["a", {"sku": "x\"y"}], "name": "p:1"},
            "token": null, "qty": 1.5, "flag": true, "big": 18446744073709551615u64,
            "esc\"aped": {"k": [1, 2, 3]}, "list": [[0, 1], {"a": {"b": "deep"}}]
        });
        let body = serde_json::to_vec(&doc).expect("json");
        let paths = [
            "product.id",
            "product.tags.1.sku",
            "product.tags.0",
            "product.tags.9",
            "product.id.x",
            "token",
            "qty",
            "flag",
            "big",
            "esc\"aped.k.2",
            "list.1.a.b",
            "list.0.1",
            "list.1",
            "list.01.a",
            "product",
            "nope",
            "product.name",
        ];
        let (w, segs) = want(&paths);
        let pruned = read(&body, &w).expect("valid");
        for (p, s) in paths.iter().zip(&segs) {
            assert_eq!(pruned.lookup(&w, s), lookup(&doc, s), "{p}");
        }
    }

    #[test]
    fn invalid_json_is_refused_even_where_nothing_is_kept() {
        let (w, _) = want(&["a"]);
        for bad in [&b"{\"a\": 1, \"b\": [1,}"[..], b"{\"a\": 1} x", b"", b"{\"a\": tru}", b"{\"b\": \"\\q\"}"] {
            assert!(read(bad, &w).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// What a `Value` parse refuses is refused, even inside members that are
    /// skipped: nesting past serde_json's 128 levels, numbers past `f64`.
    #[test]
    fn skipped_members_are_held_to_the_value_rules() {
        let (w, _) = want(&["a.b"]);
        let deep = format!(r#"{{"x": {}{}, "a": {{"b": 1}}}}"#, "[".repeat(200), "]".repeat(200));
        let shallow = format!(r#"{{"x": {}{}, "a": {{"b": 1}}}}"#, "[".repeat(100), "]".repeat(100));
        let huge = r#"{"x": 1e400, "a": {"b": 1}}"#;
        let huge_in_array = r#"{"x": [0, -1e999], "a": {"b": 1}}"#;
        for body in [deep.as_str(), shallow.as_str(), huge, huge_in_array] {
            let full = serde_json::from_str::<Value>(body);
            let pruned = read(body.as_bytes(), &w);
            assert_eq!(pruned.is_ok(), full.is_ok(), "{}: {:?}", &body[..40.min(body.len())], full.err());
        }
        assert!(read(shallow.as_bytes(), &w).is_ok());
        assert!(read(deep.as_bytes(), &w).is_err());
        assert!(read(huge.as_bytes(), &w).is_err());
    }

    #[test]
    fn the_last_duplicate_wins() {
        let (w, s) = want(&["a"]);
        let v = read(br#"{"a": 1, "a": 2}"#, &w).expect("valid");
        assert_eq!(v.lookup(&w, &s[0]), Some(&json!(2)));
    }

    #[test]
    fn a_whole_path_swallows_its_longer_paths() {
        let (w, s) = want(&["a.b", "a"]);
        let v = read(br#"{"a": {"b": 1, "c": 2}}"#, &w).expect("valid");
        assert_eq!(v.lookup(&w, &s[1]), Some(&json!({"b": 1, "c": 2})));
        assert_eq!(v.lookup(&w, &s[0]), Some(&json!(1)));
    }

    /// Two names for one array element (`1` and `01`) that want different
    /// parts of it both find theirs.
    #[test]
    fn two_names_for_one_element_each_find_their_part() {
        let doc = json!({"list": [{"a": 0}, {"a": "x", "b": "y"}]});
        let (w, s) = want(&["list.1.b", "list.01.a", "list.1"]);
        let body = serde_json::to_vec(&doc).expect("json");
        let v = read(&body, &w).expect("valid");
        for path in &s {
            assert_eq!(v.lookup(&w, path), lookup(&doc, path), "{path:?}");
        }
        let (w, s) = want(&["list.1.b", "list.01.a"]);
        let v = read(&body, &w).expect("valid");
        assert_eq!(v.lookup(&w, &s[0]), Some(&json!("y")));
        assert_eq!(v.lookup(&w, &s[1]), Some(&json!("x")));
    }
}
