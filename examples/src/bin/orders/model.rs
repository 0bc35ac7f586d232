//! Request and response shapes of the `orders` service.

use std::fmt;

use dlock_core::{escape_into, KeyPart};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// A product id as clients send it: a JSON number or a string. Both give the
/// same text (`7` and `"7"` are one product), which is also the text
/// `LockLayer::json("product_id")` puts in the lock key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ProductId(String);

impl ProductId {
    /// The id from a URL path segment.
    pub(crate) fn from_path(segment: String) -> Self {
        ProductId(segment)
    }

    /// The id as text, as stored.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as JSON: a number when it is a plain non-negative integer,
    /// else a string.
    pub(crate) fn to_json(&self) -> Value {
        match self.0.parse::<u64>() {
            Ok(n) if n.to_string() == self.0 => Value::from(n),
            _ => Value::from(self.0.as_str()),
        }
    }
}

impl fmt::Display for ProductId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl KeyPart for ProductId {
    fn write_part(&self, out: &mut String) {
        escape_into(&self.0, out)
    }
}

impl<'de> Deserialize<'de> for ProductId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(serde_json::Number),
            Text(String),
        }
        Ok(ProductId(match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Text(s) => s,
        }))
    }
}

impl Serialize for ProductId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

/// `PUT /products/{id}`.
#[derive(Debug, Deserialize)]
pub(crate) struct SetStock {
    /// Units in stock.
    pub(crate) stock: i64,
}

/// `POST /stock/reduce`.
#[derive(Debug, Deserialize)]
pub(crate) struct ReduceStock {
    /// Which product.
    pub(crate) product_id: ProductId,
    /// How many units (at least 1).
    pub(crate) quantity: i64,
}

/// The query of `POST /orders`.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenParam {
    /// The one-time submission token.
    pub(crate) token: Option<String>,
}

/// The product of an order.
#[derive(Debug, Deserialize)]
pub(crate) struct ProductRef {
    /// Which product.
    pub(crate) id: ProductId,
}

/// `POST /orders`.
#[derive(Debug, Deserialize)]
pub(crate) struct CreateOrder {
    /// What to buy.
    pub(crate) product: ProductRef,
    /// How many units (at least 1).
    pub(crate) quantity: i64,
}
