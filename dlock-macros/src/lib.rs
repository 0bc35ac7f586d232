//! `#[lockable]`: lock an axum handler on a key built from its own arguments.
//!
//! Use it through `dlock_axum::lockable`, whose documentation lists the
//! attributes; the expansion needs the runtime in `dlock_axum::__private`.
//!
//! `attr.rs` parses the attribute, `expand.rs` generates the handler. On an
//! error the handler is emitted unchanged beside the `compile_error!`, so
//! one mistake gives one error, not a cascade of errors about a function
//! that disappeared.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::quote;

mod attr;
mod expand;

/// Locks an async axum handler on a key built from its arguments; a lost
/// race is answered with `409 duplicate_submission`.
#[proc_macro_attribute]
pub fn lockable(attr: TokenStream, item: TokenStream) -> TokenStream {
    let (attr, item) = (TokenStream2::from(attr), TokenStream2::from(item));
    let expanded =
        syn::parse2::<attr::Args>(attr.clone()).and_then(|args| expand::expand(args, syn::parse2(item.clone())?, attr));
    match expanded {
        Ok(tokens) => tokens.into(),
        Err(e) => {
            let error = e.to_compile_error();
            quote! { #error #item }.into()
        }
    }
}
