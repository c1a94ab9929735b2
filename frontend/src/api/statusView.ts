/** What the status panel shows, read from GET /status whatever backend answers. */

import { ModelStatus, type ServerStatus } from "./backend";

export interface StatusView {
  state: "offline" | "loading" | "working";
  model: string | null;
  backend: string | null;
  strategy: string | null;
  device: string | null;
  workers: number | null;
  batch: number | null;
  activeSlots: number | null;
  tokensPerSecond: number | null;
}

/** A reading of the backend's cumulative token counter, to turn two polls into a rate. */
export interface TokenSample {
  total: number;
  atMs: number;
}

/** The cumulative count of generated tokens, if the backend keeps one (Albatross does). */
export function tokenSample(status: ServerStatus, atMs: number): TokenSample | null {
  const total = firstNumber(status.effective ?? {}, ["generated_tokens_total", "decode_tokens_total"]);
  return total === null ? null : { total, atMs };
}

/** Tokens per second between two polls; null when unknown or the counter went back (a new model). */
export function rateBetween(previous: TokenSample | null, current: TokenSample | null): number | null {
  if (previous === null || current === null) return null;
  const seconds = (current.atMs - previous.atMs) / 1000;
  if (seconds <= 0 || current.total < previous.total) return null;
  return (current.total - previous.total) / seconds;
}

/** `measuredRate` (from `rateBetween`) is used when the backend reports no rate of its own. */
export function statusView(status: ServerStatus, loadedModelId: string | null, measuredRate: number | null = null): StatusView {
  const effective = status.effective ?? {};
  return {
    state: status.status === ModelStatus.Working ? "working" : status.status === ModelStatus.Loading ? "loading" : "offline",
    model: firstString(status, ["model", "model_name", "name"]) ?? (status.status === ModelStatus.Working ? loadedModelId : null),
    backend: firstString(status, ["backend"]),
    strategy: firstString(status, ["strategy"]),
    device: firstString(status, ["device_name"]),
    workers: firstNumber(effective, ["worker_num", "workers"]),
    batch: firstNumber(effective, ["batch_size", "batch"]),
    activeSlots: firstNumber(effective, ["active_slots", "active", "running"]),
    tokensPerSecond: firstNumber(effective, ["tokens_per_second", "decode_tokens_per_second"]) ?? measuredRate,
  };
}

function firstString(record: Record<string, unknown>, keys: readonly string[]): string | null {
  for (const key of keys) {
    const value = record[key];
    if (typeof value === "string" && value !== "") return value;
  }
  return null;
}

function firstNumber(record: Record<string, unknown>, keys: readonly string[]): number | null {
  for (const key of keys) {
    const value = record[key];
    if (typeof value === "number" && Number.isFinite(value)) return value;
  }
  return null;
}
