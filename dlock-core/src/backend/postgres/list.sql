-- One page of the keys held or waited for ($1 the text they start with,
-- $2 the last key of the page before, '' first, $3 how many): every such
-- key has a live head in {locks} (a shared key's lives as long as its
-- holders and places). An index scan in key order from the cursor, the
-- prefix a filter (its keys are contiguous only under the C collation).
SELECT l.key FROM {locks} AS l
  WHERE l.key > $2 AND starts_with(l.key, $1) AND l.expires_at > clock_timestamp()
  ORDER BY l.key
  LIMIT $3
