"""Shared runtime of both workers: config, requests, paged KV, scheduler, model runner."""
