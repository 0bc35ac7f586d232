//! `#[lockable]`: lock an axum handler on a key built from its own arguments.
//!
//! Use it through `dlock_axum::lockable`; the expansion needs the runtime in
//! `dlock_axum`.
//!
//! ```ignore
//! use axum::{extract::Query, Json};
//! use dlock_axum::lockable;
//!
//! #[lockable(key = "order.create", fields = ["product.id", "token"], wait_ms = 0, lease_ms = 5000,
//!            message = "duplicate submission, please retry later", code = 2101)]
//! async fn create_order(Query(TokenParam { token }): Query<TokenParam>, Json(product): Json<Product>) -> String {
//!     format!("order for {}", product.id)
//! }
//! ```
//!
//! | attribute | meaning | default |
//! |---|---|---|
//! | `key = "name"` | the lock's name (required, not empty) | — |
//! | `fields = ["a.b", "c"]` | values that become key parts, each a path from a name the argument patterns bind | none |
//! | `wait_ms = n` | how long to wait for the lock (0: try once) | the engine's (`DLOCK_WAIT_MS`) |
//! | `lease_ms = n` | a fixed lease | watchdog mode (`DLOCK_LEASE_MS`, renewed) |
//! | `message = "..."` | message of the `409 duplicate_submission` answer | dlock's |
//! | `code = n` | code of that answer | `2101` |
//!
//! The handler gets one hidden first argument that finds the engine
//! installed with `with_locker`, and the request's lock owner (so a nested
//! lock on the same key in the same request re-enters). The lock is taken
//! after every extractor ran, held while the body runs, and released when it
//! returns by any path; a panicking body drops the guard, which releases it.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprArray, ExprLit, FnArg, Ident, ItemFn, Lit, LitInt, LitStr, Pat, Token};

/// Locks an async axum handler on a key built from its arguments; a lost
/// race is answered with `409 duplicate_submission`. See the crate docs.
#[proc_macro_attribute]
pub fn lockable(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr_span = proc_macro2::TokenStream::from(attr.clone());
    let args = match syn::parse::<Args>(attr) {
        Ok(args) => args,
        Err(e) => return e.to_compile_error().into(),
    };
    let func = match syn::parse::<ItemFn>(item) {
        Ok(f) => f,
        Err(e) => return e.to_compile_error().into(),
    };
    match expand(args, func, attr_span) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// One `name = value` of the attribute.
struct Setting {
    name: Ident,
    value: Expr,
}

impl Parse for Setting {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let name: Ident = input.parse()?;
        input.parse::<Token![=]>()?;
        let value: Expr = input.parse()?;
        Ok(Setting { name, value })
    }
}

/// A field path: its root name and the fields walked from it.
struct FieldPath {
    lit: LitStr,
    root: Ident,
    rest: Vec<syn::Member>,
}

#[derive(Default)]
struct Args {
    key: Option<LitStr>,
    fields: Vec<FieldPath>,
    wait_ms: Option<LitInt>,
    lease_ms: Option<LitInt>,
    max_hold_ms: Option<LitInt>,
    message: Option<LitStr>,
    code: Option<LitInt>,
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

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let settings = Punctuated::<Setting, Token![,]>::parse_terminated(input)?;
        let mut args = Args::default();
        let mut seen: Vec<String> = Vec::new();
        for Setting { name, value } in settings {
            let n = name.to_string();
            if seen.contains(&n) {
                return Err(syn::Error::new(name.span(), format!("`{n}` is given twice")));
            }
            seen.push(n.clone());
            match n.as_str() {
                "key" => {
                    let key = string(&value, "key")?;
                    if key.value().trim().is_empty() {
                        return Err(syn::Error::new(key.span(), "`key` must not be empty"));
                    }
                    args.key = Some(key);
                }
                "fields" => {
                    let Expr::Array(ExprArray { elems, .. }) = &value else {
                        return Err(syn::Error::new(
                            value.span(),
                            "`fields` takes a list of strings, e.g. `fields = [\"product.id\"]`",
                        ));
                    };
                    for e in elems {
                        args.fields.push(field_path(&string(e, "fields")?)?);
                    }
                }
                "wait_ms" => args.wait_ms = Some(integer(&value, "wait_ms", u64::from(u32::MAX))?),
                "lease_ms" => {
                    let lease = integer(&value, "lease_ms", u64::from(u32::MAX))?;
                    if lease.base10_parse::<u64>()? == 0 {
                        return Err(syn::Error::new(
                            lease.span(),
                            "`lease_ms` must be at least 1; leave it out for watchdog mode",
                        ));
                    }
                    args.lease_ms = Some(lease);
                }
                "max_hold_ms" => {
                    let max_hold = integer(&value, "max_hold_ms", u64::from(u32::MAX))?;
                    if max_hold.base10_parse::<u64>()? == 0 {
                        return Err(syn::Error::new(
                            max_hold.span(),
                            "`max_hold_ms` must be at least 1; leave it out to renew for as long as the handler runs",
                        ));
                    }
                    args.max_hold_ms = Some(max_hold);
                }
                "message" => args.message = Some(string(&value, "message")?),
                "code" => args.code = Some(integer(&value, "code", u64::from(u32::MAX))?),
                _ => {
                    return Err(syn::Error::new(
                        name.span(),
                        format!(
                            "unknown attribute `{n}`; expected one of: key, fields, wait_ms, lease_ms, max_hold_ms, message, code"
                        ),
                    ))
                }
            }
        }
        Ok(args)
    }
}

/// The names a pattern binds.
fn bindings(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            if let Some((_, sub)) = &p.subpat {
                bindings(sub, out);
            }
        }
        Pat::TupleStruct(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Tuple(p) => p.elems.iter().for_each(|e| bindings(e, out)),
        Pat::Struct(p) => p.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Reference(p) => bindings(&p.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Type(p) => bindings(&p.pat, out),
        _ => {}
    }
}

/// The pattern with `mut` and `ref` taken off its bindings, so it can match a
/// reference to the extracted value (the key is read before the body runs).
fn by_reference(pat: &Pat) -> Pat {
    let mut pat = pat.clone();
    strip(&mut pat);
    pat
}

fn strip(pat: &mut Pat) {
    match pat {
        Pat::Ident(p) => {
            p.mutability = None;
            p.by_ref = None;
            if let Some((_, sub)) = &mut p.subpat {
                strip(sub);
            }
        }
        Pat::TupleStruct(p) => p.elems.iter_mut().for_each(strip),
        Pat::Tuple(p) => p.elems.iter_mut().for_each(strip),
        Pat::Struct(p) => p.fields.iter_mut().for_each(|f| strip(&mut f.pat)),
        Pat::Reference(p) => strip(&mut p.pat),
        Pat::Paren(p) => strip(&mut p.pat),
        Pat::Type(p) => strip(&mut p.pat),
        _ => {}
    }
}

/// Whether an argument of type `ty` is filled from the lock the macro took
/// rather than extracted: `FencingToken`, `HeldLock`, or an `Option` of
/// either, by any path. The macro sees only the type's text; an alias is
/// extracted like any other argument.
fn from_lock(ty: &syn::Type) -> bool {
    fn last(ty: &syn::Type) -> Option<&syn::PathSegment> {
        match ty {
            syn::Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
            syn::Type::Paren(p) => last(&p.elem),
            syn::Type::Group(g) => last(&g.elem),
            _ => None,
        }
    }
    let lock_type = |seg: &syn::PathSegment| {
        matches!(seg.arguments, syn::PathArguments::None) && (seg.ident == "FencingToken" || seg.ident == "HeldLock")
    };
    match last(ty) {
        Some(seg) if lock_type(seg) => true,
        Some(seg) if seg.ident == "Option" => match &seg.arguments {
            syn::PathArguments::AngleBracketed(a) if a.args.len() == 1 => match a.args.first() {
                Some(syn::GenericArgument::Type(inner)) => last(inner).is_some_and(lock_type),
                _ => false,
            },
            _ => false,
        },
        _ => false,
    }
}

fn expand(args: Args, func: ItemFn, attr: TokenStream2) -> syn::Result<TokenStream2> {
    let Some(key) = args.key else {
        let span = if attr.is_empty() { func.sig.ident.span() } else { attr.span() };
        return Err(syn::Error::new(span, "`#[lockable]` needs a key: `#[lockable(key = \"order.create\")]`"));
    };
    if func.sig.asyncness.is_none() {
        return Err(syn::Error::new(func.sig.fn_token.span(), "`#[lockable]` goes on an `async fn` (an axum handler)"));
    }

    let mut idents = Vec::new();
    let mut late = Vec::new();
    let mut fills = Vec::new();
    let mut params = Vec::new();
    let mut refs = Vec::new();
    for (i, arg) in func.sig.inputs.iter().enumerate() {
        let FnArg::Typed(pt) = arg else {
            return Err(syn::Error::new(arg.span(), "`#[lockable]` handlers take no `self`"));
        };
        let name = format_ident!("__dlock_arg{}", i);
        let ty = &pt.ty;
        if from_lock(ty) {
            // Filled from the guard once the lock is taken (see the crate docs).
            bindings(&pt.pat, &mut late);
            fills.push(quote_spanned! { ty.span()=>
                let #name: #ty = <#ty as ::dlock_axum::__private::FromHeld>::from_held(&__dlock_held);
            });
            continue;
        }
        let pat = by_reference(&pt.pat);
        bindings(&pt.pat, &mut idents);
        params.push(quote! { #name: #ty });
        refs.push(quote! {
            #[allow(unused_variables, clippy::let_unit_value)]
            let #pat = &#name;
        });
    }

    let mut parts = Vec::new();
    for f in &args.fields {
        if late.contains(&f.root) {
            return Err(syn::Error::new(
                f.lit.span(),
                format!("`{}` comes from the lock itself, which is taken after the key is built", f.root),
            ));
        }
        if !idents.contains(&f.root) {
            let bound: Vec<String> = idents.iter().map(ToString::to_string).collect();
            let hint = if bound.is_empty() {
                "no argument binds a name".to_owned()
            } else {
                format!("bound: {}", bound.join(", "))
            };
            return Err(syn::Error::new(
                f.lit.span(),
                format!("`{}` is not bound by any argument of this handler ({hint})", f.root),
            ));
        }
        let root = Ident::new(&f.root.to_string(), f.lit.span());
        let rest = &f.rest;
        parts.push(quote_spanned! { f.lit.span()=> .part(&#root #(.#rest)*) });
    }

    let opt_u64 = |v: &Option<LitInt>| match v {
        Some(i) => quote! { ::core::option::Option::Some(#i) },
        None => quote! { ::core::option::Option::None },
    };
    let wait = opt_u64(&args.wait_ms);
    let lease = opt_u64(&args.lease_ms);
    let max_hold = opt_u64(&args.max_hold_ms);
    let code = opt_u64(&args.code);
    let message = match &args.message {
        Some(m) => quote! { ::core::option::Option::Some(#m) },
        None => quote! { ::core::option::Option::None },
    };

    let func_arity = func.sig.inputs.len();
    let ItemFn { attrs, vis, sig, block } = func;
    let (impl_generics, _, where_clause) = sig.generics.split_for_impl();
    let mut inner_sig = sig.clone();
    inner_sig.ident = Ident::new("__dlock_inner", Span::call_site());
    let name = &sig.ident;
    let arg_names = (0..func_arity).map(|i| format_ident!("__dlock_arg{}", i));

    Ok(quote! {
        #(#attrs)*
        #vis async fn #name #impl_generics (
            __dlock_ctx: ::dlock_axum::__private::LockContext,
            #(#params),*
        ) -> ::dlock_axum::__private::Response #where_clause {
            static __DLOCK_POLICY: ::dlock_axum::__private::Policy =
                ::dlock_axum::__private::Policy::from_attribute(#key, #wait, #lease, #max_hold, #message, #code);
            let __dlock_acquire = __dlock_ctx.acquire(&__DLOCK_POLICY, |__dlock_key| {
                #(#refs)*
                __dlock_key #(#parts)* .build()
            });
            let __dlock_held = match __dlock_acquire.await {
                ::core::result::Result::Ok(held) => held,
                ::core::result::Result::Err(refused) => return refused,
            };
            #(#fills)*
            #inner_sig #block
            __dlock_held.finish(__dlock_inner(#(#arg_names),*).await).await
        }
    })
}
