//! (slot: scenarios being written this session)
