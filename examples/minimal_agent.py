"""The smallest complete agent coevo trains: a number-guessing game, played with the `openai` SDK.

    coevo run --family external --run-id mine    # serves http://127.0.0.1:8000; its key is in a file
    OPENAI_API_KEY="$(cat runs/mine/policy-endpoint.key)" python examples/minimal_agent.py

Each game is an episode and each model call one of its steps; coevo trains the model on them. It
plays until the run stops, then exits 0.
"""

import itertools
import os
import random
import time

import openai

ROOT = os.environ.get("COEVO_URL", "http://127.0.0.1:8000")
coevo = openai.OpenAI(base_url=f"{ROOT}/v1", api_key=os.environ["OPENAI_API_KEY"], max_retries=0)


class Stopped(Exception):
    """The run is over: 503 endpoint_stopping while it drains, a refused connection once it exited."""


def call(request, *args, **kwargs):
    """``request(...)``, again after each answer's Retry-After (429 learner_behind or too_many_episodes,
    503 no_task_available). An answer without one is final: a 503 then is the run's end."""
    while True:
        try:
            return request(*args, **kwargs)
        except openai.APIStatusError as exc:
            wait = exc.response.headers.get("Retry-After")
            if wait is None and exc.status_code == 503:
                raise Stopped(exc.code) from exc
            if wait is None:
                raise
            print(f"{exc.status_code} {exc.code}: waiting {wait} s", flush=True)
            time.sleep(float(wait))
        except openai.APIConnectionError as exc:
            raise Stopped("connection refused") from exc


def play(task: int) -> str:
    """One game of task ``task`` (its number to guess): the episode opened, played, finished; its outcome."""
    body = {"task_id": f"guess-{task}", "goal": "guess the number from 0 to 9"}
    episode = call(coevo.post, f"{ROOT}/coevo/v1/episodes", body=body, cast_to=dict)  # with the run's key
    model = coevo.with_options(api_key=episode["key"])  # a call with the episode's key is one of its steps
    number, outcome, said = random.Random(task).randrange(10), "lost", "Guess my number from 0 to 9: one digit."
    messages = []
    for _ in range(3):
        messages.append({"role": "user", "content": said})
        reply = call(model.chat.completions.create, model="policy", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})  # the reply as given: coevo reuses its tokens
        guess = next((int(c) for c in text if c.isdigit()), None)
        if guess == number:
            outcome = "won"
            break
        said = "Answer with one digit." if guess is None else "Higher." if guess < number else "Lower."
    finish = f"{ROOT}/coevo/v1/episodes/{episode['episode_id']}/finish"
    call(model.post, finish, body={"outcome": outcome}, cast_to=dict)  # the episode's key dies with it
    return outcome


if __name__ == "__main__":
    for _ in range(600):  # coevo serves once its models are loaded
        try:
            coevo.models.list()
            break
        except openai.APIConnectionError:
            time.sleep(1)
    try:
        for n in itertools.count():  # the episodes of one task id form its groups (policy.n of them)
            print(f"guess-{n % 4}: {play(n % 4)}", flush=True)
    except Stopped as why:
        print(f"coevo stopped ({why})", flush=True)
