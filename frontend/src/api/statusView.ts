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

export function statusView(status: ServerStatus, loadedModelId: string | null): StatusView {
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
    tokensPerSecond: firstNumber(effective, ["tokens_per_second", "decode_tokens_per_second", "tokens_per_s"]),
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
