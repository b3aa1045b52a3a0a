//! (slot: keyspace version and capabilities, issue #19; being written this session)
