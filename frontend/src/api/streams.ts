/** Streaming generation: OpenAI chat and completions, and the native batch route. */

import type { SamplingDefaults } from "./backend";
import type { ApiClient } from "./client";
import { messageOf, StreamError } from "./errors";
import { readSse } from "./sse";

export type Sampling = SamplingDefaults;

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export interface StreamOutcome {
  text: string;
  finishReason: string | null;
  usage: Usage | null;
  /** From sending the request to the last event. */
  elapsedMs: number;
}

interface OpenAiChunk {
  choices?: { delta?: { content?: string }; text?: string; finish_reason?: string | null }[];
  usage?: Usage | null;
}

/** Completion tokens per second over the whole reply (prefill included), or null if unknown. */
export function tokensPerSecond(outcome: Pick<StreamOutcome, "usage" | "elapsedMs">): number | null {
  if (outcome.usage === null || outcome.elapsedMs <= 0) return null;
  return (outcome.usage.completion_tokens * 1000) / outcome.elapsedMs;
}

export function streamChat(
  client: ApiClient,
  messages: readonly ChatMessage[],
  sampling: Sampling,
  signal: AbortSignal,
  onText: (delta: string) => void,
): Promise<StreamOutcome> {
  const body = { messages, stream: true, stream_options: { include_usage: true }, ...sampling };
  return streamOpenAi(client, "/v1/chat/completions", body, signal, onText);
}

export function streamCompletion(
  client: ApiClient,
  prompt: string,
  sampling: Sampling,
  signal: AbortSignal,
  onText: (delta: string) => void,
): Promise<StreamOutcome> {
  const body = { prompt, stream: true, stream_options: { include_usage: true }, ...sampling };
  return streamOpenAi(client, "/v1/completions", body, signal, onText);
}

async function streamOpenAi(
  client: ApiClient,
  path: string,
  body: unknown,
  signal: AbortSignal,
  onText: (delta: string) => void,
): Promise<StreamOutcome> {
  const started = performance.now();
  const response = await client.postForStream(path, body, signal);
  const outcome: StreamOutcome = { text: "", finishReason: null, usage: null, elapsedMs: 0 };
  for await (const payload of readSse(response.body!)) {
    throwIfError(payload);
    const chunk = payload as OpenAiChunk;
    if (chunk.usage) outcome.usage = chunk.usage;
    for (const choice of chunk.choices ?? []) {
      const delta = choice.delta?.content ?? choice.text ?? "";
      if (delta) {
        outcome.text += delta;
        onText(delta);
      }
      if (choice.finish_reason) outcome.finishReason = choice.finish_reason;
    }
    outcome.elapsedMs = performance.now() - started;
  }
  return outcome;
}

/** The native batch request: the same prompt `count` times, as one streaming request. */
export function batchRequestBody(prompt: string, count: number, sampling: Sampling): Record<string, unknown> {
  return {
    contents: new Array<string>(count).fill(prompt),
    stream: true,
    max_tokens: sampling.max_tokens,
    temperature: sampling.temperature,
    top_p: sampling.top_p,
    top_k: sampling.top_k,
    alpha_presence: sampling.presence_penalty,
    alpha_frequency: sampling.frequency_penalty,
    alpha_decay: sampling.penalty_decay,
  };
}

/** Streams a native batch; `onPayload` gets every chunk (rows with news) until [DONE]. */
export async function streamBatch(
  client: ApiClient,
  prompt: string,
  count: number,
  sampling: Sampling,
  signal: AbortSignal,
  onPayload: (payload: unknown) => void,
): Promise<void> {
  const response = await client.postForStream("/v1/chat/completions", batchRequestBody(prompt, count, sampling), signal);
  for await (const payload of readSse(response.body!)) {
    throwIfError(payload);
    onPayload(payload);
  }
}

function throwIfError(payload: unknown): void {
  if (typeof payload === "object" && payload !== null && "error" in payload) {
    throw new StreamError(messageOf(payload) ?? JSON.stringify(payload));
  }
}
