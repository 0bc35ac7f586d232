//! Parsing `#[lockable(...)]`: `name = value` pairs, each keyword a
//! `syn::custom_keyword!`, read by a `lookahead1` loop that names every
//! keyword when it meets an unknown one, and reports a repeated one at its
//! second occurrence.

use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, ExprArray, ExprLit, Ident, Lit, LitInt, LitStr, Token};

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(fields);
    syn::custom_keyword!(wait_ms);
    syn::custom_keyword!(lease_ms);
    syn::custom_keyword!(max_hold_ms);
    syn::custom_keyword!(message);
    syn::custom_keyword!(code);
    syn::custom_keyword!(mode);
    syn::custom_keyword!(permits);
    syn::custom_keyword!(also);
}

/// How the keys are taken: `mode = "exclusive" | "shared"`, or
/// `permits = n` (a semaphore).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Exclusive,
    Shared,
}

/// A further key, `also(key = "...", fields = [...])`.
pub(crate) struct AlsoKey {
    pub(crate) key: LitStr,
    pub(crate) fields: Vec<FieldPath>,
}

/// A field path: its root name and the fields walked from it.
pub(crate) struct FieldPath {
    pub(crate) lit: LitStr,
    pub(crate) root: Ident,
    pub(crate) rest: Vec<syn::Member>,
}

/// What one `#[lockable(...)]` says; `key` is checked to be present by the
/// expansion, which knows where to point when it is not.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Option<LitStr>,
    pub(crate) fields: Vec<FieldPath>,
    pub(crate) wait_ms: Option<LitInt>,
    pub(crate) lease_ms: Option<LitInt>,
    pub(crate) max_hold_ms: Option<LitInt>,
    pub(crate) message: Option<LitStr>,
    pub(crate) code: Option<LitInt>,
    /// `mode = "..."`, with the span of its value.
    pub(crate) mode: Option<(Mode, proc_macro2::Span)>,
    pub(crate) permits: Option<LitInt>,
    /// The further keys, in the order written.
    pub(crate) also: Vec<AlsoKey>,
    /// Whether `fields` was given (an empty list counts).
    fields_given: bool,
}

/// The longest wait, lease or max hold in milliseconds (about 49 days), and
/// the largest code: what fits a `u32`.
const MAX: u64 = u32::MAX as u64;

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::key) {
                let span = input.parse::<kw::key>()?.span;
                let key = string(&value(input)?, "key")?;
                if key.value().trim().is_empty() {
                    return Err(syn::Error::new(key.span(), "`key` must not be empty"));
                }
                once(&mut args.key, key, span, "key")?;
            } else if lookahead.peek(kw::fields) {
                let span = input.parse::<kw::fields>()?.span;
                if args.fields_given {
                    return Err(twice(span, "fields"));
                }
                args.fields_given = true;
                args.fields = fields(&value(input)?)?;
            } else if lookahead.peek(kw::wait_ms) {
                let span = input.parse::<kw::wait_ms>()?.span;
                once(&mut args.wait_ms, integer(&value(input)?, "wait_ms", MAX)?, span, "wait_ms")?;
            } else if lookahead.peek(kw::lease_ms) {
                let span = input.parse::<kw::lease_ms>()?.span;
                let lease = positive(integer(&value(input)?, "lease_ms", MAX)?, "lease_ms", "for watchdog mode")?;
                once(&mut args.lease_ms, lease, span, "lease_ms")?;
            } else if lookahead.peek(kw::max_hold_ms) {
                let span = input.parse::<kw::max_hold_ms>()?.span;
                let max_hold = positive(
                    integer(&value(input)?, "max_hold_ms", MAX)?,
                    "max_hold_ms",
                    "to renew for as long as the handler runs",
                )?;
                once(&mut args.max_hold_ms, max_hold, span, "max_hold_ms")?;
            } else if lookahead.peek(kw::message) {
                let span = input.parse::<kw::message>()?.span;
                once(&mut args.message, string(&value(input)?, "message")?, span, "message")?;
            } else if lookahead.peek(kw::code) {
                let span = input.parse::<kw::code>()?.span;
                once(&mut args.code, integer(&value(input)?, "code", MAX)?, span, "code")?;
            } else if lookahead.peek(kw::mode) {
                let span = input.parse::<kw::mode>()?.span;
                let lit = string(&value(input)?, "mode")?;
                let mode = match lit.value().as_str() {
                    "exclusive" => Mode::Exclusive,
                    "shared" => Mode::Shared,
                    other => {
                        return Err(syn::Error::new(
                            lit.span(),
                            format!(
                                "unknown mode `{other}`: `mode` is \"exclusive\" (the default) or \"shared\"; \
                                 for a semaphore write `permits = n`"
                            ),
                        ))
                    }
                };
                if args.permits.is_some() {
                    return Err(semaphore_and_mode(span));
                }
                once(&mut args.mode, (mode, lit.span()), span, "mode")?;
            } else if lookahead.peek(kw::permits) {
                let span = input.parse::<kw::permits>()?.span;
                let permits = positive(
                    integer(&value(input)?, "permits", MAX)?,
                    "permits",
                    "for a lock one request holds at a time",
                )?;
                if args.mode.is_some() {
                    return Err(semaphore_and_mode(span));
                }
                once(&mut args.permits, permits, span, "permits")?;
            } else if lookahead.peek(kw::also) {
                input.parse::<kw::also>()?;
                let content;
                let parens = syn::parenthesized!(content in input);
                args.also.push(also(&content, parens.span.join())?);
            } else {
                return Err(lookahead.error());
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(args)
    }
}

fn semaphore_and_mode(keyword: proc_macro2::Span) -> syn::Error {
    syn::Error::new(
        keyword,
        "`permits` and `mode` cannot go together: `permits = n` is a semaphore (n requests at once), \
         `mode` an exclusive or shared lock; give one of them",
    )
}

/// The inside of `also(key = "...", fields = [...])`: a further key of the
/// route, with its own name and fields; everything else is the route's and
/// goes outside.
fn also(input: ParseStream<'_>, parens: proc_macro2::Span) -> syn::Result<AlsoKey> {
    let mut key = None;
    let mut fields = None;
    while !input.is_empty() {
        let lookahead = input.lookahead1();
        if lookahead.peek(kw::key) {
            let span = input.parse::<kw::key>()?.span;
            let lit = string(&value(input)?, "key")?;
            if lit.value().trim().is_empty() {
                return Err(syn::Error::new(lit.span(), "`key` must not be empty"));
            }
            once(&mut key, lit, span, "key")?;
        } else if lookahead.peek(kw::fields) {
            let span = input.parse::<kw::fields>()?.span;
            once(&mut fields, self::fields(&value(input)?)?, span, "fields")?;
        } else if input.peek(syn::Ident) {
            let name: Ident = input.fork().parse()?;
            return Err(syn::Error::new(
                name.span(),
                format!(
                    "`also(..)` takes only `key` and `fields`; `{name}` applies to every key of the route: \
                     write it outside `also(..)`"
                ),
            ));
        } else {
            return Err(lookahead.error());
        }
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    let Some(key) = key else {
        return Err(syn::Error::new(parens, "`also(..)` needs a key: `also(key = \"account\", fields = [\"t.to\"])`"));
    };
    Ok(AlsoKey { key, fields: fields.unwrap_or_default() })
}

/// `= <expression>`: the value is parsed as any expression and checked
/// afterwards, so a wrong kind of value gets a message naming the attribute.
fn value(input: ParseStream<'_>) -> syn::Result<Expr> {
    input.parse::<Token![=]>()?;
    input.parse()
}

fn once<T>(slot: &mut Option<T>, value: T, keyword: proc_macro2::Span, name: &str) -> syn::Result<()> {
    if slot.is_some() {
        return Err(twice(keyword, name));
    }
    *slot = Some(value);
    Ok(())
}

fn twice(keyword: proc_macro2::Span, name: &str) -> syn::Error {
    syn::Error::new(keyword, format!("`{name}` is given twice"))
}

fn string(value: &Expr, what: &str) -> syn::Result<LitStr> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Str(s), .. }) => Ok(s.clone()),
        other => Err(syn::Error::new(other.span(), format!("`{what}` takes a string literal"))),
    }
}

fn integer(value: &Expr, what: &str, max: u64) -> syn::Result<LitInt> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Int(i), .. }) => {
            let n: u64 =
                i.base10_parse().map_err(|_| syn::Error::new(i.span(), format!("`{what}` takes a whole number")))?;
            if n > max {
                return Err(syn::Error::new(i.span(), format!("`{what}` must be at most {max}")));
            }
            Ok(i.clone())
        }
        other => Err(syn::Error::new(other.span(), format!("`{what}` takes a whole number, e.g. `{what} = 5000`"))),
    }
}

fn positive(i: LitInt, what: &str, otherwise: &str) -> syn::Result<LitInt> {
    if i.base10_parse::<u64>()? == 0 {
        return Err(syn::Error::new(i.span(), format!("`{what}` must be at least 1; leave it out {otherwise}")));
    }
    Ok(i)
}

fn fields(value: &Expr) -> syn::Result<Vec<FieldPath>> {
    let Expr::Array(ExprArray { elems, .. }) = value else {
        return Err(syn::Error::new(
            value.span(),
            "`fields` takes a list of strings, e.g. `fields = [\"product.id\"]`",
        ));
    };
    elems.iter().map(|e| field_path(&string(e, "fields")?)).collect()
}

fn field_path(lit: &LitStr) -> syn::Result<FieldPath> {
    let text = lit.value();
    let mut segments = text.split('.');
    let bad = || syn::Error::new(lit.span(), format!("`{text}` is not a field path like `product.id`"));
    let root = segments.next().filter(|s| !s.is_empty()).ok_or_else(bad)?;
    let root: Ident = syn::parse_str(root).map_err(|_| bad())?;
    let mut rest = Vec::new();
    for seg in segments {
        let member: syn::Member = syn::parse_str(seg).map_err(|_| bad())?;
        rest.push(member);
    }
    Ok(FieldPath { lit: lit.clone(), root, rest })
}
