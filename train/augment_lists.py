"""Built-in material for `augment` where the training prompts hold none: foreign sentences, roles, code.

All written for this project. Foreign sentences are composed (subject x predicate, optionally a second
main clause joined by a coordinating conjunction, which keeps word order simple in every language);
every subject is third person singular so every predicate fits it.
"""

from __future__ import annotations

import random

# ---- foreign sentences (translated into English) ----------------------------------------------------------
_GERMAN = {
    "people": [
        "Meine Schwester", "Mein Bruder", "Der alte Nachbar", "Die junge Ärztin", "Unser Lehrer",
        "Die Bürgermeisterin", "Ein Freund von mir", "Der Koch", "Meine Großmutter", "Der neue Kollege",
        "Die Studentin", "Der Busfahrer", "Die Journalistin", "Mein Onkel",
    ],
    "person_predicates": [
        "liest jeden Abend ein Buch über die Geschichte Europas",
        "arbeitet seit drei Jahren in einem kleinen Krankenhaus",
        "fährt am Wochenende mit dem Fahrrad an den See", "hat gestern einen Brief an die Stadtverwaltung geschrieben",
        "kocht am Sonntag immer für die ganze Familie", "möchte im nächsten Sommer nach Italien reisen",
        "hat die Prüfung trotz der kurzen Vorbereitung bestanden", "wartet schon seit einer Stunde auf den Zug",
        "sucht eine günstige Wohnung in der Nähe des Bahnhofs", "hat im Garten Tomaten und Kartoffeln gepflanzt",
        "trinkt morgens eine Tasse Kaffee ohne Zucker", "verkauft auf dem Markt frisches Gemüse aus der Region",
        "hat das alte Haus am Stadtrand renoviert", "lernt seit dem Herbst Spanisch an der Volkshochschule",
        "geht jeden Morgen vor der Arbeit im Park joggen", "interessiert sich sehr für moderne Kunst",
        "hat den Termin beim Zahnarzt leider vergessen", "besucht regelmäßig die Ausstellungen im Museum",
        "hat am Freitag ein neues Auto gekauft", "schreibt gerade an einem Roman über eine kleine Insel",
    ],
    "places": ["Das Hotel", "Die Ferienwohnung", "Das Restaurant", "Die Pension", "Das Gasthaus", "Der Campingplatz"],
    "place_predicates": [
        "liegt nur wenige Minuten vom Bahnhof entfernt", "bietet einen schönen Blick auf die Berge",
        "ist das ganze Jahr über geöffnet", "wurde vor zwei Jahren komplett renoviert",
        "verfügt über einen großen Garten mit Terrasse", "liegt direkt am Ufer des Sees",
        "ist mit öffentlichen Verkehrsmitteln gut zu erreichen", "bietet jeden Morgen ein reichhaltiges Frühstück an",
    ],
    "bodies": ["Die Regierung", "Der Stadtrat", "Das Unternehmen", "Die Universität", "Der Verein", "Die Bank"],
    "body_predicates": [
        "hat am Dienstag neue Pläne für den Verkehr vorgestellt", "will bis zum Jahr 2035 klimaneutral werden",
        "hat die Preise für Eintrittskarten deutlich erhöht", "sucht dringend neue Mitarbeiterinnen und Mitarbeiter",
        "feiert in diesem Jahr ihr hundertjähriges Bestehen", "hat ein neues Programm für junge Familien gestartet",
        "muss wegen der hohen Kosten sparen", "hat den Vertrag mit dem Lieferanten verlängert",
    ],
    "conjunctions": [", aber ", ", und ", ", denn "],
    "clauses": [
        "die Kinder spielen im Park", "der Zug hatte wieder Verspätung", "die Preise sind stark gestiegen",
        "das Wetter ist heute ungewöhnlich warm", "niemand wusste davon", "die Stadt plant eine neue Straßenbahnlinie",
        "der Winter war sehr lang", "am Abend regnet es oft", "viele Menschen sind damit nicht zufrieden",
        "die Straße ist seit Montag gesperrt",
    ],
    "standalone": [
        "Können Sie mir bitte sagen, wie ich zum Bahnhof komme?", "Wir haben uns sehr über Ihre Einladung gefreut.",
        "Die Veranstaltung findet bei jedem Wetter statt.",
        "Bitte schließen Sie beim Verlassen des Raumes die Fenster.",
        "Im Preis sind Frühstück und Parkplatz bereits enthalten.",
        "Nach dem Essen machten wir einen langen Spaziergang.",
        "Ich hätte gern einen Tisch für vier Personen am Fenster.", "Das Museum ist montags geschlossen.",
        "Wegen Bauarbeiten fällt der Unterricht morgen aus.", "Hast du schon gehört, dass Anna nach Berlin zieht?",
    ],
}  # fmt: skip

_FRENCH = {
    "people": [
        "Ma sœur", "Mon frère", "Le vieux voisin", "Notre professeur", "La directrice", "Un ami à moi",
        "Le cuisinier", "Ma grand-mère", "Le nouveau collègue", "L'étudiante", "Le chauffeur de bus", "Mon oncle",
    ],
    "person_predicates": [
        "lit un livre sur l'histoire de l'Europe chaque soir", "travaille depuis trois ans dans un petit hôpital",
        "va au lac à vélo le week-end", "a écrit hier une lettre à la mairie",
        "prépare le repas pour toute la famille le dimanche", "voudrait voyager en Italie l'été prochain",
        "attend le train depuis une heure", "cherche un appartement pas trop cher près de la gare",
        "a planté des tomates et des pommes de terre dans le jardin", "boit un café sans sucre tous les matins",
        "vend des légumes frais au marché", "apprend l'espagnol le soir depuis l'automne",
        "court dans le parc tous les matins avant le travail", "s'intéresse beaucoup à l'art moderne",
        "a oublié le rendez-vous chez le dentiste", "visite souvent les expositions du musée",
        "a acheté une nouvelle voiture vendredi", "écrit un roman sur une petite île",
    ],
    "places": ["L'hôtel", "L'appartement", "Le restaurant", "La pension", "Le camping", "Le gîte"],
    "place_predicates": [
        "se trouve à quelques minutes de la gare", "offre une belle vue sur les montagnes", "est ouvert toute l'année",
        "a été entièrement rénové il y a deux ans", "dispose d'un grand jardin avec terrasse",
        "est situé au bord du lac",
        "est facilement accessible en transports en commun", "propose chaque matin un petit-déjeuner copieux",
    ],
    "bodies": ["Le gouvernement", "Le conseil municipal", "L'entreprise", "L'université", "L'association", "La banque"],
    "body_predicates": [
        "a présenté mardi de nouveaux projets pour les transports", "veut atteindre la neutralité carbone d'ici 2035",
        "a fortement augmenté le prix des billets", "cherche de toute urgence de nouveaux employés",
        "fête cette année son centième anniversaire", "a lancé un nouveau programme pour les jeunes familles",
        "doit faire des économies à cause des coûts élevés", "a prolongé son contrat avec le fournisseur",
    ],
    "conjunctions": [", mais ", ", et ", ", car "],
    "clauses": [
        "les enfants jouent dans le parc", "le train avait encore du retard", "les prix ont beaucoup augmenté",
        "il fait exceptionnellement chaud aujourd'hui", "personne n'était au courant",
        "la ville prévoit une nouvelle ligne de tramway", "l'hiver a été très long", "il pleut souvent le soir",
        "beaucoup de gens ne sont pas contents", "la rue est fermée depuis lundi",
    ],
    "standalone": [
        "Pourriez-vous me dire comment aller à la gare, s'il vous plaît ?", "Nous avons été ravis de votre invitation.",
        "L'événement aura lieu quel que soit le temps.", "Merci de fermer les fenêtres en quittant la salle.",
        "Le petit-déjeuner et le parking sont compris dans le prix.",
        "Après le repas, nous avons fait une longue promenade.",
        "Je voudrais une table pour quatre personnes près de la fenêtre.", "Le musée est fermé le lundi.",
        "En raison de travaux, les cours n'auront pas lieu demain.", "Tu as appris qu'Anna déménage à Lyon ?",
    ],
}  # fmt: skip

_SPANISH = {
    "people": [
        "Mi hermana", "Mi hermano", "El viejo vecino", "Nuestro profesor", "La directora", "Un amigo mío",
        "El cocinero", "Mi abuela", "El nuevo compañero", "La estudiante", "El conductor del autobús", "Mi tío",
    ],
    "person_predicates": [
        "lee cada noche un libro sobre la historia de Europa", "trabaja desde hace tres años en un pequeño hospital",
        "va en bicicleta al lago los fines de semana", "escribió ayer una carta al ayuntamiento",
        "cocina los domingos para toda la familia", "quiere viajar a Italia el próximo verano",
        "espera el tren desde hace una hora", "busca un piso barato cerca de la estación",
        "plantó tomates y patatas en el jardín", "toma un café sin azúcar todas las mañanas",
        "vende verduras frescas en el mercado", "aprende alemán por las tardes desde el otoño",
        "corre en el parque todas las mañanas antes del trabajo", "se interesa mucho por el arte moderno",
        "olvidó la cita con el dentista", "visita a menudo las exposiciones del museo",
        "compró un coche nuevo el viernes", "escribe una novela sobre una pequeña isla",
    ],
    "places": ["El hotel", "El apartamento", "El restaurante", "La pensión", "El camping", "La casa rural"],
    "place_predicates": [
        "está a pocos minutos de la estación", "ofrece una bonita vista de las montañas", "está abierto todo el año",
        "fue renovado por completo hace dos años", "dispone de un gran jardín con terraza", "está junto al lago",
        "tiene buen acceso en transporte público", "sirve cada mañana un desayuno abundante",
    ],
    "bodies": ["El gobierno", "El ayuntamiento", "La empresa", "La universidad", "La asociación", "El banco"],
    "body_predicates": [
        "presentó el martes nuevos planes de transporte", "quiere ser neutral en carbono antes de 2035",
        "subió mucho el precio de las entradas", "busca con urgencia nuevos empleados",
        "celebra este año su centenario", "lanzó un nuevo programa para familias jóvenes",
        "tiene que ahorrar por los costes elevados", "prolongó el contrato con el proveedor",
    ],
    "conjunctions": [", pero ", ", y ", ", porque "],
    "clauses": [
        "los niños juegan en el parque", "el tren llegó tarde otra vez", "los precios han subido mucho",
        "hoy hace un calor poco habitual", "nadie lo sabía", "la ciudad planea una nueva línea de tranvía",
        "el invierno fue muy largo", "por la noche llueve a menudo", "mucha gente no está contenta",
        "la calle está cortada desde el lunes",
    ],
    "standalone": [
        "¿Podría decirme cómo llegar a la estación, por favor?", "Nos alegró mucho recibir su invitación.",
        "El evento se celebrará haga el tiempo que haga.", "Por favor, cierren las ventanas al salir de la sala.",
        "El desayuno y el aparcamiento están incluidos en el precio.", "Después de comer dimos un largo paseo.",
        "Quisiera una mesa para cuatro personas junto a la ventana.", "El museo cierra los lunes.",
        "Por obras, mañana no habrá clase.", "¿Te has enterado de que Ana se muda a Sevilla?",
    ],
}  # fmt: skip

FOREIGN = {"German": _GERMAN, "French": _FRENCH, "Spanish": _SPANISH}


def foreign_sentence(rng: random.Random, language: str) -> str:
    """One composed sentence in ``language`` (German, French or Spanish), sometimes two."""
    lists = FOREIGN[language]
    roll = rng.random()
    if roll < 0.12:
        return rng.choice(lists["standalone"])
    group = rng.choices(["people", "places", "bodies"], weights=[6, 2, 2])[0]
    predicates = {"people": "person_predicates", "places": "place_predicates", "bodies": "body_predicates"}[group]
    sentence = f"{rng.choice(lists[group])} {rng.choice(lists[predicates])}"
    if rng.random() < 0.4:
        sentence += rng.choice(lists["conjunctions"]) + rng.choice(lists["clauses"])
    sentence += "."
    if rng.random() < 0.3:
        sentence += " " + foreign_sentence(rng, language)
    return sentence


# ---- roles --------------------------------------------------------------------------------------------------
ROLES = [
    "a seasoned ship captain", "a medieval blacksmith", "a detective in 1920s London", "a friendly librarian",
    "a Michelin-star chef", "a personal fitness coach", "a relationship coach", "a travel agent",
    "a stand-up comedian", "a museum tour guide", "a Shakespearean actor", "an astronaut on a space station",
    "a startup founder pitching to investors", "a customer support agent for an internet provider",
    "a grumpy old wizard", "a pirate captain", "a kindergarten teacher", "a sports commentator",
    "a hard-boiled private investigator", "Sherlock Holmes", "a Roman senator", "a park ranger",
    "a job interviewer at a tech company", "a high school guidance counselor", "a nutritionist",
    "a real estate agent", "a time traveler from the year 3000", "a robot learning about human feelings",
    "a barista in a busy cafe", "a wise village elder", "a news anchor", "a flight attendant",
    "a veterinarian", "a medieval court jester", "a marine biologist", "a cheerful radio DJ",
    "a strict but fair judge", "a sommelier", "a fantasy innkeeper", "an art critic", "a tour bus driver",
    "a philosophy professor", "a famous novelist giving an interview", "a film director on set",
    "a personal finance advisor", "a mountain guide", "a dragon who guards a library", "a historian of ancient Egypt",
    "a concierge at a luxury hotel", "a tech-savvy grandmother", "a poet who only speaks in rhymes",
    "a knight returning from a long quest", "a ghost haunting an old theater", "a game show host",
    "a lighthouse keeper", "a career coach", "a diplomat at a peace conference", "a farmer at a market stall",
]  # fmt: skip
COUNTERPARTS = [
    "a curious tourist", "a nervous new customer", "a young apprentice", "a journalist", "a skeptical investor",
    "a lost traveler", "your oldest friend", "a student who missed class", "a rival", "a child full of questions",
]  # fmt: skip

# ---- writing --------------------------------------------------------------------------------------------------
WRITING_TOPICS = [
    "working from home", "learning a second language as an adult", "the first day at a new job", "urban gardening",
    "a rainy Sunday afternoon", "saving money on groceries", "the joy of reading paper books", "moving to a new city",
    "volunteering at an animal shelter", "a long train journey", "public libraries", "the history of tea",
    "electric cars", "a surprise birthday party", "recycling at home", "a small bakery that is about to close",
    "the four-day work week", "sleep and productivity", "a lost dog finding its way home",
    "night skies without light pollution",
    "visiting grandparents", "a hiking trip that went wrong", "starting a podcast", "cooking with children",
    "the value of boredom", "street food", "a town festival", "the last day of school", "cycling to work",
    "smartphones at the dinner table", "a letter found in an old book", "climate change in coastal towns",
]  # fmt: skip
PRODUCTS = [
    "a reusable water bottle that tracks how much you drink", "a neighborhood bike repair shop",
    "a language-learning app",
    "a solar-powered phone charger", "a family-run Italian restaurant", "a weekend pottery class",
    "noise-cancelling headphones",
    "a smart plant pot", "a second-hand bookshop", "an online tutoring service", "a compact folding e-bike",
    "a meal-kit delivery service", "a dog-walking business", "a board game cafe", "an ergonomic office chair",
    "a local farmers' market", "a travel backpack with a built-in lock", "a budgeting spreadsheet template",
]  # fmt: skip
AUDIENCES = [
    "teenagers", "busy parents", "retirees", "small business owners", "university students", "first-time travelers",
    "software engineers", "beginners", "a general audience", "local residents",
]  # fmt: skip
TONES = ["friendly", "formal", "persuasive", "humorous", "concise", "enthusiastic", "apologetic", "warm"]

# ---- coding ---------------------------------------------------------------------------------------------------
# (what the function does, a name for it)
CODING_TASKS = [
    ("returns the second largest number in a list of integers", "second_largest"),
    ("checks whether a string is a palindrome, ignoring case, spaces and punctuation", "is_palindrome"),
    ("counts the vowels in a string", "count_vowels"),
    ("returns the n-th Fibonacci number", "fibonacci"),
    ("merges two sorted lists into one sorted list", "merge_sorted"),
    ("finds the longest common prefix of a list of strings", "common_prefix"),
    ("removes duplicates from a list while keeping the original order", "unique_in_order"),
    ("flattens a nested list of any depth", "flatten"),
    ("computes the factorial of a non-negative integer", "factorial"),
    ("checks whether a number is prime", "is_prime"),
    ("returns all primes up to n with the Sieve of Eratosthenes", "primes_up_to"),
    ("reverses the order of the words in a sentence", "reverse_words"),
    ("converts a Roman numeral to an integer", "roman_to_int"),
    ("converts a non-negative integer to a binary string without built-in conversion", "to_binary"),
    ("returns the indices of the two numbers in a list that add up to a target", "two_sum"),
    ("groups a list of words into lists of anagrams", "group_anagrams"),
    ("returns the k most frequent words in a text", "most_common_words"),
    ("checks whether a string looks like a valid email address", "is_valid_email"),
    ("returns the median of a list of numbers", "median"),
    ("rotates a square matrix 90 degrees clockwise", "rotate_matrix"),
    ("returns the largest sum of a contiguous sublist", "max_subarray"),
    ("checks whether the brackets in a string are balanced", "is_balanced"),
    ("searches a sorted list with binary search", "binary_search"),
    ("computes the greatest common divisor of two integers", "gcd"),
    ("computes the edit (Levenshtein) distance between two strings", "edit_distance"),
    ("finds the longest substring without repeated characters", "longest_unique_substring"),
    ("computes how long the longest common subsequence of two strings is", "lcs_length"),
    ("splits a list into chunks of a given size", "chunk"),
    ("converts a snake_case string to camelCase", "snake_to_camel"),
    ("checks whether two strings are anagrams of each other", "is_anagram"),
    ("counts the islands of 1s in a 2-D grid of 0s and 1s", "count_islands"),
    ("returns every subset of a list", "power_set"),
    ("returns every permutation of a string", "permutations"),
    ("formats a number of seconds as HH:MM:SS", "format_duration"),
    ("counts the lines, words and characters of a text file", "file_stats"),
    ("returns the k-th smallest element of an unsorted list", "kth_smallest"),
    ("adds up the digits of a number until a single digit remains", "digital_root"),
    ("computes compound interest for a principal, yearly rate and number of years", "compound_interest"),
    ("transposes a matrix given as a list of rows", "transpose"),
    ("finds the missing number in a list holding 0..n with one number missing", "missing_number"),
    ("parses a query string such as 'a=1&b=2' into a dictionary", "parse_query"),
    ("checks whether a year is a leap year", "is_leap_year"),
    ("returns the running average of a list of numbers", "running_average"),
    ("finds all pairs of numbers in a list whose difference is k", "pairs_with_difference"),
    ("validates a Sudoku row, column and box layout", "is_valid_sudoku"),
    ("compresses a string with run-length encoding ('aaabb' -> 'a3b2')", "run_length_encode"),
    ("returns the intersection of two lists, each element once", "intersection"),
    ("checks whether a linked list has a cycle", "has_cycle"),
    ("converts a dictionary of lists into a list of dictionaries", "dict_of_lists_to_rows"),
    ("wraps a long text into lines of at most a given width", "wrap_text"),
]  # fmt: skip
CODING_CLASSES = [
    "a stack with push, pop and a constant-time min operation", "an LRU cache with get and put",
    "a queue built from two stacks", "a bank account with deposit, withdraw and a transaction history",
    "a simple to-do list with add, complete and list operations", "a rate limiter that allows n calls per second",
    "a min-heap with push and pop", "a trie that supports insert and prefix search",
    "a 2-D vector with addition, scaling and length", "an inventory that tracks items and their quantities",
]  # fmt: skip
CODING_LANGUAGES = ["Python"] * 10 + ["JavaScript"] * 6 + ["TypeScript", "C++", "Java", "Go", "Rust"]
CODING_EXTRAS = [
    "", "", "", "Include type hints and a docstring.", "Make it run in O(n) time.", "Do not use any built-in sorting.",
    "Include three example calls with their expected output.", "Handle empty input gracefully.",
    "Explain its time and space complexity afterwards.", "Write unit tests for it as well.",
    "Keep it under 15 lines.", "Add comments explaining each step.", "Use recursion.", "Avoid recursion.",
    "Raise a clear error for invalid input.",
]  # fmt: skip

# (language, what it does, code, (text to replace, replacement) that plants a bug)
SNIPPETS = [
    ("Python", "returns the second largest number in a list", '''def second_largest(numbers):
    first = second = float("-inf")
    for n in numbers:
        if n > first:
            first, second = n, first
        elif first > n > second:
            second = n
    return second''', ("elif first > n > second", "elif n > second")),
    ("Python", "checks whether a string is a palindrome, ignoring punctuation and case", '''def is_palindrome(text):
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]''', (" if c.isalnum()", "")),
    ("Python", "returns the n-th Fibonacci number", '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a''', ("range(n)", "range(n - 1)")),
    ("Python", "finds the index of a target in a sorted list", '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1''', ("while low <= high", "while low < high")),
    ("Python", "merges two sorted lists", '''def merge_sorted(left, right):
    merged, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged''', ("\n    merged.extend(right[j:])", "")),
    ("Python", "checks whether a number is prime", '''def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True''', ("while i * i <= n", "while i * i < n")),
    ("Python", "checks whether brackets are balanced", '''def is_balanced(text):
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in pairs:
            if not stack or stack.pop() != pairs[char]:
                return False
    return not stack''', ("return not stack", "return True")),
    ("Python", "returns the largest sum of a contiguous sublist", '''def max_subarray(numbers):
    best = current = numbers[0]
    for n in numbers[1:]:
        current = max(n, current + n)
        best = max(best, current)
    return best''', ("best = current = numbers[0]", "best = current = 0")),
    ("Python", "returns the k most common words of a text", '''def most_common_words(text, k):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:\\"'")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)[:k]''', ("counts.get(word, 0) + 1", "1")),
    ("Python", "removes duplicates while keeping order", '''def unique_in_order(items):
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result''', ("\n            seen.add(item)", "")),
    ("Python", "returns the median of a list", '''def median(numbers):
    ordered = sorted(numbers)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2''', ("ordered = sorted(numbers)", "ordered = numbers")),
    ("Python", "computes the length of the longest common subsequence", '''def lcs_length(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            if a[i - 1] == b[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    return table[len(a)][len(b)]''', ("table[i - 1][j - 1] + 1", "table[i - 1][j] + 1")),
    ("Python", "converts a Roman numeral to an integer", '''def roman_to_int(numeral):
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, char in enumerate(numeral):
        value = values[char]
        if i + 1 < len(numeral) and values[numeral[i + 1]] > value:
            total -= value
        else:
            total += value
    return total''', ("values[numeral[i + 1]] > value", "values[numeral[i + 1]] >= value")),
    ("Python", "flattens a nested list", '''def flatten(items):
    result = []
    for item in items:
        if isinstance(item, list):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result''', ("result.extend(flatten(item))", "result.extend(item)")),
    ("JavaScript", "delays calling a function until calls stop for a given time", '''function debounce(fn, delay) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delay);
  };
}''', ("    clearTimeout(timer);\n", "")),
    ("JavaScript", "splits an array into chunks of a given size", '''function chunk(array, size) {
  const chunks = [];
  for (let i = 0; i < array.length; i += size) {
    chunks.push(array.slice(i, i + size));
  }
  return chunks;
}''', ("array.slice(i, i + size)", "array.slice(i, size)")),
    ("JavaScript", "converts snake_case to camelCase", '''function snakeToCamel(text) {
  return text.replace(/_([a-z])/g, (_, letter) => letter.toUpperCase());
}''', ("/g,", "/,")),
    ("JavaScript", "adds up the digits of a number until one digit remains", '''function digitalRoot(n) {
  while (n >= 10) {
    n = String(n).split("").reduce((sum, d) => sum + Number(d), 0);
  }
  return n;
}''', ("sum + Number(d)", "sum + d")),
    ("JavaScript", "checks whether two strings are anagrams", '''function isAnagram(a, b) {
  const normalize = (s) => s.toLowerCase().replace(/[^a-z]/g, "").split("").sort().join("");
  return normalize(a) === normalize(b);
}''', (".sort()", "")),
    ("JavaScript", "makes a deep copy of nested objects and arrays", '''function deepClone(value) {
  if (value === null || typeof value !== "object") return value;
  if (Array.isArray(value)) return value.map(deepClone);
  const copy = {};
  for (const [key, item] of Object.entries(value)) copy[key] = deepClone(item);
  return copy;
}''', ("copy[key] = deepClone(item)", "copy[key] = item")),
    ("JavaScript", "finds two indices whose numbers add up to a target", '''function twoSum(numbers, target) {
  const seen = new Map();
  for (let i = 0; i < numbers.length; i++) {
    const need = target - numbers[i];
    if (seen.has(need)) return [seen.get(need), i];
    seen.set(numbers[i], i);
  }
  return null;
}''', ("    const need = target - numbers[i];\n",
        "    seen.set(numbers[i], i);\n    const need = target - numbers[i];\n")),
    ("JavaScript", "formats seconds as HH:MM:SS", '''function formatDuration(seconds) {
  const h = Math.floor(seconds / 3600);
  const m = Math.floor((seconds % 3600) / 60);
  const s = seconds % 60;
  return [h, m, s].map((part) => String(part).padStart(2, "0")).join(":");
}''', ("Math.floor((seconds % 3600) / 60)", "Math.floor(seconds / 60)")),
]  # fmt: skip

# ---- explanations ------------------------------------------------------------------------------------------------
STEM_CONCEPTS = [
    "photosynthesis", "entropy", "Newton's third law", "the Doppler effect", "natural selection", "plate tectonics",
    "the greenhouse effect", "DNA replication", "the central limit theorem", "Bayes' theorem", "compound interest",
    "the Pythagorean theorem", "electromagnetic induction", "osmosis", "the water cycle", "black holes",
    "vaccines and the immune system", "public-key cryptography", "how a transistor works", "the speed of light",
    "chemical equilibrium", "half-life in radioactive decay", "the nitrogen cycle", "supply voltage and current",
    "machine learning overfitting", "recursion in programming", "the big O notation", "how GPS finds a position",
    "the structure of an atom", "cellular respiration", "ocean tides", "the seasons on Earth", "antibiotic resistance",
    "how batteries store energy", "the mitochondria", "prime numbers", "derivatives in calculus",
    "probability distributions",
    "acids and bases", "the carbon cycle", "how airplanes fly", "sound waves", "the periodic table",
    "climate feedback loops",
    "how the heart pumps blood", "enzymes", "gravity and orbits", "refraction of light",
    "the hash table data structure",
    "how vaccines are tested", "exponential growth", "the Fibonacci sequence in nature", "friction",
    "neurons and synapses",
]  # fmt: skip
STEM_PAIRS = [
    ("mitosis", "meiosis"), ("weather", "climate"), ("speed", "velocity"), ("a virus", "a bacterium"),
    ("an atom", "a molecule"), ("nuclear fission", "nuclear fusion"), ("RAM", "storage"), ("mass", "weight"),
    ("conduction", "convection"), ("a compiler", "an interpreter"), ("DNA", "RNA"), ("correlation", "causation"),
    ("series circuits", "parallel circuits"), ("heat", "temperature"), ("a comet", "an asteroid"), ("TCP", "UDP"),
]  # fmt: skip
HUMANITIES_CONCEPTS = [
    "the social contract", "Renaissance humanism", "utilitarianism", "the Industrial Revolution", "the printing press",
    "the separation of powers", "existentialism", "the Silk Road", "impressionism in painting", "the Enlightenment",
    "Stoicism", "the fall of the Roman Empire", "the Cold War", "the abolition of slavery", "the French Revolution",
    "supply and demand", "opportunity cost", "cultural relativism", "the hero's journey in storytelling",
    "the role of the chorus in Greek tragedy", "the Harlem Renaissance", "colonialism and its legacy",
    "the invention of writing", "Confucian ethics", "the Magna Carta", "modernism in literature", "propaganda",
    "the tragedy of the commons", "free will and determinism", "the Reformation", "minimalism in art",
    "the welfare state", "nationalism in the nineteenth century", "oral traditions",
    "the ethics of artificial intelligence",
    "the Universal Declaration of Human Rights", "globalization", "the history of the Olympic Games",
    "Baroque music", "satire as social criticism", "the stages of life and how cultures mark them",
    "civil disobedience",
]  # fmt: skip
HUMANITIES_PAIRS = [
    ("Plato", "Aristotle"), ("capitalism", "socialism"), ("the Renaissance", "the Middle Ages"),
    ("democracy in ancient Athens", "modern representative democracy"), ("tragedy", "comedy"),
    ("Romanticism", "Realism"), ("Stoicism", "Epicureanism"), ("the American Revolution", "the French Revolution"),
    ("Kant's ethics", "utilitarian ethics"), ("poetry", "prose"),
]  # fmt: skip
WORKS = [
    "Hamlet", "Pride and Prejudice", "Nineteen Eighty-Four", "The Odyssey", "Don Quixote", "Moby-Dick",
    "To Kill a Mockingbird", "Frankenstein", "The Great Gatsby", "Things Fall Apart", "Macbeth", "Jane Eyre",
]  # fmt: skip
THEMES = ["ambition", "identity", "power", "loyalty", "justice", "freedom", "memory", "love and duty", "isolation"]
GRADES = ["fifth-grade", "middle school", "ninth-grade", "high school", "first-year university", "adult-education"]

# ---- names for puzzles ------------------------------------------------------------------------------------------
NAMES = [
    "Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kofi", "Lena",
    "Mateo", "Nadia", "Oscar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf",
]  # fmt: skip
FEMALE_NAMES = ["Alice", "Chloe", "Emma", "Grace", "Isla", "Lena", "Nadia", "Priya", "Rosa", "Tara", "Vera"]
