//! Generating a `#[lockable]` handler.
//!
//! The handler keeps its name, visibility, attributes and generics; it gets
//! one hidden first argument (`__private::LockContext`: the engine and the
//! request's lock owner) and returns `__private::Response`. Its body becomes
//! the nested `__dlock_inner` with the user's own signature, so type errors
//! still point at the user's `-> T`. In order, the generated code
//!
//! 1. lets axum run every extractor of the handler except the arguments that
//!    come from the lock (`FencingToken`, `HeldLock`, `Option` of either);
//! 2. builds the key from the `fields`, and one more key per `also(..)`,
//!    read by reference from the bound argument patterns;
//! 3. acquires through the pipeline of `LockLayer` (`LockContext::acquire`:
//!    the policy's mode, several keys all or none), which answers a refusal
//!    itself;
//! 4. fills the lock's arguments from the guard (`__private::FromHeld`);
//! 5. runs the body and releases (`Held::finish`); a panicking body drops the
//!    guard, which releases it in the background.

use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, Ident, ItemFn, LitInt, LitStr, Pat};

use crate::attr::{Args, FieldPath, Mode};

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
        matches!(seg.arguments, syn::PathArguments::None)
            && (seg.ident == "FencingToken" || seg.ident == "HeldLock" || seg.ident == "HeldLocks")
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

/// The expression building one key, `name` with the values of `fields`
/// as its parts, in the closure the expansion gives `LockContext::acquire`.
fn key_expr(name: &LitStr, fields: &[FieldPath], idents: &[Ident], late: &[Ident]) -> syn::Result<TokenStream2> {
    let mut parts = Vec::new();
    for f in fields {
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
    Ok(quote! { __dlock_locker.key(#name) #(#parts)* .build()? })
}

pub(crate) fn expand(args: Args, func: ItemFn, attr: TokenStream2) -> syn::Result<TokenStream2> {
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

    let mut keys = vec![key_expr(&key, &args.fields, &idents, &late)?];
    for also in &args.also {
        keys.push(key_expr(&also.key, &also.fields, &idents, &late)?);
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

    let policy = quote! { ::dlock_axum::__private::policy(#key, #wait, #lease, #max_hold, #message, #code) };
    let policy = match (&args.mode, &args.permits) {
        (Some((Mode::Shared, span)), _) => quote_spanned! { *span=> ::dlock_axum::__private::shared(#policy) },
        (_, Some(n)) => quote_spanned! { n.span()=> ::dlock_axum::__private::permits(#policy, #n) },
        _ => policy,
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
            static __DLOCK_POLICY: ::dlock_axum::__private::Policy = #policy;
            let __dlock_acquire = __dlock_ctx.acquire(&__DLOCK_POLICY, |__dlock_locker| {
                #(#refs)*
                ::core::result::Result::Ok([#(#keys),*])
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
